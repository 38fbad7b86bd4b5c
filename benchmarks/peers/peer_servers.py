"""How to start each server under comparison, wait for it and stop it.

omlx and ``mlx_lm.server`` run from the project's .venv. Other MLX servers from PyPI
live in their own venvs under ``--peer-venvs`` (default /tmp/omlx-peers/venvs/<name>),
never in the project's; ``install_peer`` creates one and links the BLAS into its
``mlx[cpu]`` the way setup.sh does for ours (OpenBLAS, with omlx's small-batch matmul in
front unless the server runs with OMLX_FASTGEMM=0).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
OMLX_MAIN = "import sys; from omlx.cli import main; sys.exit(main())"


@dataclass(slots=True)
class ServerSpec:
    name: str
    argv: list[str]
    model: str  # the model name the client sends
    port: int
    ready_path: str = "/v1/models"
    env: dict[str, str] = field(default_factory=dict)
    # Directories made for this start only (a base path, a HOME); removed at stop:
    # a peer's HOME fills with its saved prefix cache (~0.5 GB a start).
    scratch: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def free_port() -> int:
    """A port nobody listens on now. Never a fixed one: this machine is shared, and a
    fixed port once sent another benchmark's clients to our server (and ours to theirs)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerFailed(RuntimeError):
    """A server did not install, start or answer; the message says why."""


def omlx_spec(model_dir: Path, model: str, port: int, tree: Path | None = None) -> ServerSpec:
    """omlx from the project's .venv, running this checkout or ``tree`` (another
    commit's code, first on the path: ``-P`` keeps the working directory off it)."""
    # A fresh base path: empty SSD cache and settings. The prefix cache is on by default;
    # 16 slots so the 16-stream row runs as one batch (the default admits 8).
    base = tempfile.mkdtemp(prefix="omlx-peers-base-")
    command = [str(VENV_BIN / "omlx")]
    env = {}
    if tree is not None:
        command = [str(VENV_BIN / "python"), "-P", "-c", OMLX_MAIN]
        env["PYTHONPATH"] = str(tree)
    argv = [*command, "--base-path", base, "serve", "--model-dir", str(model_dir)]
    argv += ["--port", str(port), "--max-concurrent-requests", "16", "--no-install-default"]
    return ServerSpec("omlx", argv, model, port, "/health", env, scratch=[base])


def mlx_lm_spec(model_path: Path, port: int) -> ServerSpec:
    # Defaults: decode concurrency 32, prompt concurrency 8, prompt cache of 10 entries.
    argv = [str(VENV_BIN / "python"), "-m", "mlx_lm", "server", "--model", str(model_path)]
    # Its /v1/models scans the Hugging Face cache and fails without one; /health does not.
    return ServerSpec("mlx-lm", [*argv, "--port", str(port)], "default_model", port, "/health")


# No network here but PyPI: keep the Hugging Face hub and telemetry from trying.
PEER_ENV = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "RAPID_MLX_TELEMETRY": "0"}


def peer_spec(name: str, argv: list[str], model: str, port: int) -> ServerSpec:
    # A fresh HOME per start: rapid-mlx saves its prefix cache under ~/.cache at shutdown
    # and loads it at start; omlx starts on an empty cache too (fresh --base-path).
    home = tempfile.mkdtemp(prefix="omlx-peers-home-")
    env = {**PEER_ENV, "HOME": home}
    return ServerSpec(name, argv, model, port, env=env, scratch=[home])


def vllm_mlx_spec(venv: Path, model_path: Path, port: int) -> ServerSpec:
    # Without --continuous-batching it serves one request at a time (its SimpleEngine).
    argv = [str(venv / "bin" / "vllm-mlx"), "serve", str(model_path), "--port", str(port)]
    argv += ["--continuous-batching"]
    return peer_spec("vllm-mlx", argv, str(model_path), port)


def rapid_mlx_spec(venv: Path, model_path: Path, port: int) -> ServerSpec:
    # Continuous batching and the prefix cache are its defaults.
    argv = [str(venv / "bin" / "rapid-mlx"), "serve", str(model_path), "--port", str(port)]
    argv += ["--disable-model-downloads"]
    return peer_spec("rapid-mlx", argv, str(model_path), port)


def install_peer(package: str, venv: Path, log: Path) -> None:
    """pip-install ``package`` into its own venv (once) and link OpenBLAS into its mlx.

    On Linux the peers depend on plain ``mlx``, which has no backend there (importing
    mlx.core fails: libmlx.so missing), so ``mlx[cpu]`` is installed beside them."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    done = venv / ".installed"
    if not done.exists():
        with log.open("a") as out:
            cmd = [str(py), "-m", "pip", "install", package]
            cmd += ["mlx[cpu]"] if sys.platform.startswith("linux") else []
            proc = subprocess.run(cmd, stdout=out, stderr=out)
        if proc.returncode != 0:
            raise ServerFailed(f"pip install {package} failed (see {log})")
        done.touch()
    link_blas(venv)


def link_blas(venv: Path) -> None:
    """Point a peer venv's mlx[cpu] at the library setup.sh gives ours: OpenBLAS behind
    omlx's small-batch matmul, which a server started with OMLX_FASTGEMM=0 bypasses
    (run_peers --blas decides who gets it)."""
    # omlx.blas uses the stdlib only, so the peer's interpreter can run it from the repo.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([str(venv / "bin" / "python"), "-m", "omlx.blas", "link"], env=env, check=False)


class RunningServer:
    """A started server process; ``stop`` ends it (SIGINT, then SIGKILL)."""

    def __init__(self, spec: ServerSpec, log: Path, timeout_s: float = 300) -> None:
        self.spec = spec
        self.log = log
        with log.open("a") as out:
            out.write(f"$ {' '.join(spec.argv)}\n")
        out = log.open("a")
        self.proc = subprocess.Popen(
            spec.argv,
            cwd=ROOT,
            env={**os.environ, **spec.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, so stop() reaches its children too
        )
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        url = f"http://127.0.0.1:{self.spec.port}{self.spec.ready_path}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise ServerFailed(f"{self.spec.name} exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerFailed(f"{self.spec.name} not ready after {timeout_s:.0f} s: {self.tail()}")

    def tail(self, num_chars: int = 1500) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        """End the server (if still running) and remove its scratch directories."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for path in self.spec.scratch:
            shutil.rmtree(path, ignore_errors=True)
