"""Distributed omlx servers for tests: two ranks on loopback with MLX's ring backend
on the CPU, started by ``mlx.launch`` or (to kill one rank alone) as it starts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.fixtures.servers import ROOT, free_port
from tests.fixtures.servers import serve_args as fixture_serve_args

MLX_LAUNCH = Path(sys.executable).with_name("mlx.launch")


def serve_args(base: Path, model_dir: Path, port: int, model: str, mode: str) -> list[str]:
    distributed = ("--distributed", model, "--distributed-mode", mode)
    return fixture_serve_args(base, model_dir, port, "--max-concurrent-requests", "8", *distributed)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 120) -> dict:
    """/health once the model is loaded on every rank; raises if a rank exited or the
    load failed."""
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a rank exited with {proc.returncode} before serving")
        try:
            health = httpx.get(url + "/health").json()
            if health.get("models_state") == "ready":
                return health
            if health.get("models_state") == "failed":
                raise RuntimeError(f"the model did not load: {health['models']}")
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no ready server at {url} in {timeout_s} s")
        time.sleep(0.1)


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGINT to each process group (as Ctrl-C in mlx.launch's terminal), then SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def launched(base: Path, model_dir: Path, model: str, mode: str) -> Iterator[str]:
    """``mlx.launch -n 2 --backend ring -- omlx serve --distributed MODEL``: rank 0's URL."""
    port = free_port()
    cmd = [
        sys.executable,
        str(MLX_LAUNCH),
        "-n",
        "2",
        "--backend",
        "ring",
        "--starting-port",
        str(free_port()),
        "--python",
        sys.executable,
        "--",
        *serve_args(base, model_dir, port, model, mode),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [proc])
        yield url
    finally:
        stop([proc])


@contextmanager
def ranks_by_hand(base: Path, model_dir: Path, model: str, mode: str) -> Iterator[tuple[str, list]]:
    """The two ranks started as mlx.launch starts them (its ring hostfile, MLX_RANK), but
    without its rule of stopping every rank when one fails: a test can kill rank 1 and
    watch rank 0. Yields (rank 0's URL, [rank 0, rank 1] processes)."""
    port = free_port()
    hostfile = base / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    procs = []
    for rank in (0, 1):
        env = {**_env(), "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
        args = serve_args(base / f"rank{rank}", model_dir, port, model, mode)
        procs.append(
            subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, start_new_session=True)
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, procs)
        yield url, procs
    finally:
        stop(procs)
