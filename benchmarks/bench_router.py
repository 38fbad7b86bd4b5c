"""The router's added latency: TTFT through ``omlx router`` vs straight to the backend.

    .venv/bin/python benchmarks/bench_router.py [--model-dir DIR] [--requests 50]

Starts one ``omlx serve`` (prefix cache off, so no request is a cache hit) and
one ``omlx router`` in front of it, both as subprocesses, warms the model up,
then sends ``--requests`` short streaming chat requests each way, **interleaved**
(direct, routed, direct, ...; never at the same time), each with a distinct
prompt. TTFT is the time from sending the request to the first content chunk.
Prints p50/p99 of both and of the per-pair difference (routed - direct).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_health(proc: subprocess.Popen, url: str, log: Path) -> None:
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited: {log.read_text()[-2000:]}")
        time.sleep(0.02)


def start(args: list[str], url: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "omlx.cli", *args], cwd=ROOT, stderr=log.open("w")
    )
    wait_health(proc, url, log)
    return proc


def ttft(http: httpx.Client, url: str, model: str, prompt: str, tokens: int) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                first = time.perf_counter() - started
                break
        else:
            raise SystemExit("no content chunk")
        for _ in lines:  # drain: the next request starts on an idle server
            pass
    return first


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, default=Path("~/.omlx/models").expanduser())
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=50, help="per path")
    parser.add_argument("--tokens", type=int, default=4, help="max_tokens per request")
    parser.add_argument("--port", type=int, default=0, help="the server's (default: a free one)")
    parser.add_argument("--router-port", type=int, default=0, help="default: a free one")
    args = parser.parse_args()
    if not (args.model_dir / args.model).exists():
        from omlx.models.builtin import install_default_model

        install_default_model(args.model_dir)
    # Free ports by default: a fixed one may be another benchmark's server.
    args.port = args.port or free_port()
    args.router_port = args.router_port or free_port()
    tmp = Path(tempfile.mkdtemp(prefix="omlx-bench-router-"))
    direct = f"http://127.0.0.1:{args.port}"
    routed = f"http://127.0.0.1:{args.router_port}"
    serve = start(
        ["--base-path", str(tmp / "base"), "serve", "--model-dir", str(args.model_dir),
         "--port", str(args.port), "--no-install-default", "--no-cache"],
        direct, tmp / "serve.log",
    )  # fmt: skip
    router = None
    try:
        router = start(
            ["router", "--backend", direct, "--port", str(args.router_port)],
            routed,
            tmp / "router.log",
        )
        times: dict[str, list[float]] = {"direct": [], "router": []}
        with httpx.Client(timeout=600) as http:
            for i in range(5):  # load the model, warm both paths up
                ttft(http, direct, args.model, f"warm up {i}", args.tokens)
                ttft(http, routed, args.model, f"warm up again {i}", args.tokens)
            for i in range(args.requests):
                prompt = f"Question {i}: name a colour and a number."
                times["direct"].append(ttft(http, direct, args.model, prompt + " (d)", args.tokens))
                times["router"].append(ttft(http, routed, args.model, prompt + " (r)", args.tokens))
    finally:
        for proc in (router, serve):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    added = [r - d for d, r in zip(times["direct"], times["router"], strict=True)]
    print(f"model {args.model}, {args.requests} interleaved pairs, max_tokens {args.tokens}")
    print(f"{'path':14} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, values in (*times.items(), ("added (pair)", added)):
        print(
            f"{name:14} {percentile(values, 0.5) * 1e3:8.1f} {percentile(values, 0.99) * 1e3:8.1f}"
            f" {statistics.mean(values) * 1e3:8.1f}"
        )


if __name__ == "__main__":
    main()
