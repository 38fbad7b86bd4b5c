"""A model whose forward kills its process fails its load; the server keeps serving
(issue 41, defect 7; engine/arch_probe.py).

mlx-lm's phi3small segfaults on this CPU backend from 12 prompt tokens: the real
crash, in a real child process. These tests turn ``models.probe_new_architectures``
on (tests/conftest.py turns it off for the rest of the suite).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest

from omlx.engine.arch_probe import ArchitectureKey, ArchitectureProbe
from omlx.errors import ArchitectureCrashError
from omlx.models.discovery import discover_models
from omlx.settings import Settings
from tests.fixtures.breadth_models import build_breadth_model
from tests.fixtures.servers import live_server

PROBE_ON = {"probe_new_architectures": True}


@pytest.fixture(scope="module")
def crash_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama, a second tiny llama and a tiny phi3small."""
    root = tmp_path_factory.mktemp("crash-models")
    build_breadth_model(root / "tiny-llama", "llama", seed=1)
    build_breadth_model(root / "tiny-llama-b", "llama", seed=2)
    build_breadth_model(root / "tiny-phi3small", "phi3small", seed=1)
    return root


def _chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_a_crashing_architecture_fails_its_load_and_the_server_serves_on(
    tmp_path: Path, crash_models: Path
) -> None:
    with live_server(tmp_path, crash_models, models=PROBE_ON) as server:
        url = server.base_url
        crashed = _chat(url, "tiny-phi3small")
        assert crashed.status_code == 501, crashed.text
        error = crashed.json()["error"]
        assert error["code"] == "model_architecture_crashed"
        message = error["message"]
        assert "'tiny-phi3small' (architecture phi3small) crashed the probe process" in message
        assert "(signal SIGSEGV)" in message or "(signal SIGABRT)" in message
        assert "omlx will not load it in the server process" in message
        # The other model answers, in this (the server's) process.
        answered = _chat(url, "tiny-llama")
        assert answered.status_code == 200, answered.text
        assert answered.json()["choices"][0]["message"]["content"] is not None
        health = httpx.get(url + "/health").json()
        failed = next(m for m in health["models"] if m["name"] == "tiny-phi3small")
        assert failed == {"name": "tiny-phi3small", "state": "failed", "reason": message}
        models = httpx.get(url + "/admin/api/models").json()["models"]
        row = next(m for m in models if m["name"] == "tiny-phi3small")
        assert row["state"] == "failed" and row["error"] == message
        # The verdict is kept: asked again, the refusal comes at once, without a child.
        again = _chat(url, "tiny-phi3small")
        assert again.status_code == 501 and again.json()["error"]["message"] == message
        verdicts = json.loads((tmp_path / "profiles" / "architectures.json").read_text())
        by_type = {k.split(" | ")[0]: v["verdict"] for k, v in verdicts["verdicts"].items()}
        assert by_type == {"phi3small": "crashed", "llama": "ok"}


def _probe(base: Path, models: Path) -> ArchitectureProbe:
    return ArchitectureProbe(Settings(base_path=base, models={"model_dirs": [models], **PROBE_ON}))


def _probed(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "in a child process" in r.getMessage()]


def test_a_verified_architecture_starts_no_child_again(
    tmp_path: Path, crash_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    infos = discover_models([crash_models])
    probe = _probe(tmp_path, crash_models)
    caplog.set_level(logging.INFO, logger="omlx.engine.arch_probe")
    asyncio.run(probe.verify(infos["tiny-llama"]))
    assert len(_probed(caplog)) == 1
    # Another llama folder (other weights), by a new probe object as after a restart.
    asyncio.run(_probe(tmp_path, crash_models).verify(infos["tiny-llama-b"]))
    assert len(_probed(caplog)) == 1
    verdicts = json.loads(probe.path.read_text())["verdicts"]
    assert verdicts == {ArchitectureKey.of(infos["tiny-llama"]).text(): {
        "verdict": "ok", "model": "tiny-llama"
    }}  # fmt: skip


def test_another_mlx_version_probes_the_architecture_again(
    tmp_path: Path, crash_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The verdict file's key is edited to another MLX version, as after an upgrade
    (the installed MLX cannot be swapped inside a test): the next load probes anew."""
    info = discover_models([crash_models])["tiny-llama"]
    key = ArchitectureKey.of(info)
    probe = _probe(tmp_path, crash_models)
    caplog.set_level(logging.INFO, logger="omlx.engine.arch_probe")
    asyncio.run(probe.verify(info))
    older = key.text().replace(f"mlx {key.mlx} ", "mlx 0.0.1 ")
    assert older != key.text()
    probe.path.write_text(json.dumps({"format": 1, "verdicts": {older: {"verdict": "ok"}}}))
    asyncio.run(probe.verify(info))
    assert len(_probed(caplog)) == 2
    verdicts = json.loads(probe.path.read_text())["verdicts"]
    assert set(verdicts) == {older, key.text()}


def test_a_probe_that_times_out_fails_the_load_and_is_not_kept(
    tmp_path: Path, crash_models: Path
) -> None:
    """A child that has not finished when the timeout comes (here 50 ms, well before
    its imports are done) is killed; the load fails, and the next load probes again."""
    info = discover_models([crash_models])["tiny-llama"]
    settings = Settings(base_path=tmp_path, models={"model_dirs": [crash_models], **PROBE_ON})
    probe = ArchitectureProbe(settings, timeout_s=0.05)
    with pytest.raises(ArchitectureCrashError) as refused:
        asyncio.run(probe.verify(info))
    assert refused.value.http_status == 501
    assert "did not finish its first forward in the probe process within 0 s" in str(refused.value)
    assert not probe.path.exists()
