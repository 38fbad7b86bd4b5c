"""Seed 003: no MLX call on the HTTP path. /health, /metrics, the admin memory
view and the enforcer read the numbers the MLX thread published; MLX's memory
counters are only ever called on the MLX worker thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

MLX_MEMORY_CALLS = ("get_active_memory", "get_peak_memory", "reset_peak_memory", "get_cache_memory")
POLL_S = 0.2


@pytest.fixture
def mlx_callers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(function, thread name) of every call to MLX's memory counters; each call
    goes through to the real function."""
    calls: list[tuple[str, str]] = []

    def recorded(name: str, real: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            calls.append((name, threading.current_thread().name))
            return real()

        return call

    for name in MLX_MEMORY_CALLS:
        monkeypatch.setattr(mx, name, recorded(name, getattr(mx, name)))
    return calls


@pytest.fixture
def server(tiny_models_dir: Path, tmp_path: Path) -> Iterator[Server]:
    with live_server(tmp_path, tiny_models_dir, memory={"poll_interval_s": POLL_S}) as srv:
        yield srv


def metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[-1])


def test_http_path_and_enforcer_make_no_mlx_call(
    server: Server, mlx_callers: list[tuple[str, str]]
) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        ask = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert http.post("/v1/completions", json=ask).status_code == 200
        mlx_callers.clear()
        for _ in range(5):
            assert http.get("/health").status_code == 200
            metrics = http.get("/metrics")
            assert metrics.status_code == 200
            assert http.get("/admin/api/memory").status_code == 200
            time.sleep(POLL_S)  # the enforcer polls meanwhile
        # The numbers the MLX thread published reach the HTTP answers (tiny-llama's
        # weights are about 0.5 MB; the process footprint far more).
        assert metric(metrics.text, "omlx_memory_mlx_active_bytes") > 400_000
        assert http.get("/health").json()["memory"]["current_bytes"] > 10_000_000
    threads = {thread for _, thread in mlx_callers}
    assert threads == {"mlx-worker"}, mlx_callers
