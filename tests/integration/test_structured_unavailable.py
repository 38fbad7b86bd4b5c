"""Without xgrammar, structured output is refused (400 with the fix), never ignored."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.fixtures.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_structured_output_without_xgrammar_is_a_400_saying_how_to_fix_it(
    tiny_models_dir: Path, tmp_path: Path
) -> None:
    shadow = tmp_path / "shadow" / "xgrammar"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'xgrammar'\")\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    cmd = [
        sys.executable,
        "-m",
        "omlx.cli",
        "--base-path",
        str(tmp_path / "base"),
        "serve",
        "--model-dir",
        str(tiny_models_dir),
        "--port",
        str(port),
        "--no-install-default",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/health")
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
        }
        refused = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={**body, "response_format": {"type": "json_object"}},
        )
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert "xgrammar" in message and "pip install --no-deps xgrammar" in message
        free = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert free.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
