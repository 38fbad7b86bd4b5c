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


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **(extra or {})}


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
def launched(
    base: Path, model_dir: Path, model: str, mode: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """``mlx.launch -n 2 --backend ring -- omlx serve --distributed MODEL``: rank 0's URL.
    ``env``: settings for every rank (``OMLX_...`` variables)."""
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
        # Each rank's stdin is /dev/null: see _quiet_launcher.
        *("--python", "/bin/sh", "--", "-c", 'exec "$@" </dev/null', "rank", sys.executable),
        *serve_args(base, model_dir, port, model, mode),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(env), start_new_session=True, stdin=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _quiet_launcher(proc)
        wait_ready(url, [proc])
        _quiet_launcher(proc)  # again: a rank that held its stdin then holds it no more
        yield url
    finally:
        stop([proc])
        assert proc.stdin is not None
        proc.stdin.close()


def _quiet_launcher(proc: subprocess.Popen[bytes]) -> None:
    """Stop mlx.launch's busy polling (suite time, issue 38). It reads its stdin
    without a wait once that is at its end (pytest's /dev/null), and polls each rank's
    stdin pipe for writing without a wait while the pipe is open: its threads took a
    core from the ranks (over 150 of test_builtin_model.py's 376 CPU seconds). Here
    its stdin is a pipe kept open (its read waits 0.1 s), and a byte it forwards to
    ranks that closed their stdin fails with EPIPE, after which it only waits for
    their output."""
    assert proc.stdin is not None
    proc.stdin.write(b"\n")
    proc.stdin.flush()


@contextmanager
def ranks_by_hand(
    base: Path,
    model_dir: Path,
    model: str,
    mode: str,
    env: dict[int, dict[str, str]] | None = None,
    logs: Path | None = None,
) -> Iterator[tuple[str, list]]:
    """The two ranks started as mlx.launch starts them (its ring hostfile, MLX_RANK), but
    without its rule of stopping every rank when one fails: a test can kill rank 1 and
    watch rank 0. ``env``: settings of one rank (``{1: {"OMLX_...": ...}}``). ``logs``:
    a folder for each rank's output (``rank0.log``, ``rank1.log``) instead of the
    test's. Yields (rank 0's URL, [rank 0, rank 1] processes)."""
    port = free_port()
    hostfile = base / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    procs = []
    for rank in (0, 1):
        rank_env = {
            **_env((env or {}).get(rank)),
            "MLX_HOSTFILE": str(hostfile),
            "MLX_RANK": str(rank),
        }
        args = serve_args(base / f"rank{rank}", model_dir, port, model, mode)
        output = (logs / f"rank{rank}.log").open("wb") if logs else None
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                env=rank_env,
                start_new_session=True,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
            )
        )
        if output is not None:
            output.close()  # the rank holds its own copy
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, procs)
        yield url, procs
    finally:
        stop(procs)
