"""``omlx router`` from the command line: refused setups, and a real run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from omlx.cli import main
from tests.fixtures.servers import ROOT, free_port
from tests.router.conftest import C_KEY, Fleet


def test_no_backend_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router"]) == 2
    assert "give at least one --backend URL" in capsys.readouterr().err


def test_remote_bind_without_key_is_refused(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["router", "--backend", fleet.a.base_url, "--host", "0.0.0.0"]) == 2
    assert "without an API key" in capsys.readouterr().err


def test_router_runs_with_keys_from_the_environment(fleet: Fleet) -> None:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMLX_ROUTER_API_KEY": "cli-router-key",
        "OMLX_ROUTER_BACKEND_KEYS": json.dumps({fleet.c.base_url: C_KEY}),
    }
    cmd = [sys.executable, "-m", "omlx.cli", "router", "--port", str(port),
           "--backend", fleet.a.base_url, "--backend", fleet.c.base_url]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        health = _wait_health(proc, url)
        assert [b["healthy"] for b in health["backends"]] == [True, True]
        client = openai.OpenAI(base_url=url + "/v1", api_key="cli-router-key", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "routing" in stderr and C_KEY not in stderr and "cli-router-key" not in stderr


def _wait_health(proc: subprocess.Popen[str], url: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, "omlx router exited"
        try:
            return httpx.get(url + "/health").json()
        except httpx.TransportError:
            assert time.monotonic() < deadline, "omlx router did not answer /health"
            time.sleep(0.05)
