"""Distributed serving against one process: tokens/s of the same model and prompts.

    .venv/bin/python benchmarks/bench_distributed.py [--tokens 64] [--rounds 2]

For tensor parallel (a llama) and pipeline parallel (a qwen2) model of the same
shape (random weights, 512 hidden, 8 layers, float32), alternates rounds of
``omlx serve`` (one process) and ``mlx.launch -n 2 --backend ring -- omlx serve
--distributed`` (two ranks on loopback), never at the same time. Each round
measures one stream's decode rate ((N - 1) / (last token - first token)) and the
aggregate of 4 concurrent streams (completion tokens / wall time), temperature 0
and ``ignore_eos`` so every run decodes exactly N tokens. Prints medians per
setup and the distributed / single ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.tiny_models import build_tiny_model  # noqa: E402

MODELS = {"tensor": ("bench-llama", "llama"), "pipeline": ("bench-qwen2", "qwen2")}
CONCURRENT = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start(dirs: Path, model: str, mode: str | None) -> tuple[subprocess.Popen, str]:
    """One process (mode None) or two ranks; returns when the model is loaded."""
    port = free_port()
    serve = ["-m", "omlx.cli", "--base-path", str(dirs / "base"), "serve"]
    serve += ["--model-dir", str(dirs / "models"), "--port", str(port), "--no-install-default"]
    serve += ["--no-cache", "--default-model", model]
    if mode is None:
        cmd = [sys.executable, *serve]
    else:
        launch = Path(sys.executable).with_name("mlx.launch")
        cmd = [sys.executable, str(launch), "-n", "2", "--backend", "ring", "--python"]
        cmd += [sys.executable, "--starting-port", str(free_port()), "--", *serve]
        cmd += ["--distributed", model, "--distributed-mode", mode]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (dirs / "server.log").open("a")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited; see {dirs / 'server.log'}")
        try:
            if httpx.get(url + "/health", timeout=5).json().get("models_state") == "ready":
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not get ready in 300 s")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def stream(url: str, model: str, prompt: str, tokens: int) -> tuple[int, float, float]:
    """(tokens, time of first token, time of last token), perf_counter seconds."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = 0.0
    count = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    return count, first, last


def measure(url: str, model: str, tokens: int) -> dict[str, float]:
    stream(url, model, "warm up", 8)
    n, first, last = stream(url, model, "Tell me about the sea.", tokens)
    single = (n - 1) / (last - first)
    prompts = [f"Story number {i}: once upon a time" for i in range(CONCURRENT)]
    started = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        done = list(pool.map(lambda p: stream(url, model, p, tokens), prompts))
    aggregate = sum(d[0] for d in done) / (time.perf_counter() - started)
    return {"single": single, "aggregate": aggregate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        dirs = Path(tmp)
        for name, arch in MODELS.values():
            build_tiny_model(dirs / "models" / name, "slow-llama", seed=5, model_type=arch)
        for mode, (model, _) in MODELS.items():
            results: dict[str, list[dict[str, float]]] = {"one process": [], "2 ranks": []}
            for _ in range(args.rounds):
                for setup, split in (("one process", None), ("2 ranks", mode)):
                    proc, url = start(dirs, model, split)
                    try:
                        results[setup].append(measure(url, model, args.tokens))
                    finally:
                        stop(proc)
            report(mode, model, results)


def report(mode: str, model: str, results: dict[str, list[dict[str, float]]]) -> None:
    print(f"\n{mode} parallel ({model}, 512 hidden x 8 layers, float32)")
    print("| metric | one process | 2 ranks | ratio | per-round 2 ranks / one |")
    print("|---|---|---|---|---|")
    for metric, label in (
        ("single", "single stream decode tok/s"),
        ("aggregate", "aggregate tok/s, 4 concurrent"),
    ):
        one = [r[metric] for r in results["one process"]]
        two = [r[metric] for r in results["2 ranks"]]
        rounds = " ".join(f"{b / a:.2f}" for a, b in zip(one, two, strict=True))
        ratio = statistics.median(two) / statistics.median(one)
        medians = f"{statistics.median(one):.1f} | {statistics.median(two):.1f}"
        print(f"| {label} | {medians} | {ratio:.2f} | {rounds} |")


if __name__ == "__main__":
    main()
