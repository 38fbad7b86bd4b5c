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
    return ttft_at(http, url, model, prompt, tokens)[0]


def ttft_at(
    http: httpx.Client, url: str, model: str, prompt: str, tokens: int
) -> tuple[float, str]:
    """(TTFT in seconds, the backend that served it: ``x-omlx-backend``, or the URL)."""
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
    return first, response.headers.get("x-omlx-backend", url)


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
    parser.add_argument(
        "--affinity", action="store_true", help="instead: cache-hit TTFT over 2 backends"
    )
    parser.add_argument("--docs", type=int, default=6, help="long documents (--affinity)")
    args = parser.parse_args()
    if not (args.model_dir / args.model).exists():
        from omlx.models.builtin import install_default_model

        install_default_model(args.model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="omlx-bench-router-"))
    if args.affinity:
        affinity(args, tmp)
    else:
        added_latency(args, tmp)


def serve_cmd(args: argparse.Namespace, base: Path, port: int, *flags: str) -> list[str]:
    return ["--base-path", str(base), "serve", "--model-dir", str(args.model_dir),
            "--port", str(port), "--no-install-default", *flags]  # fmt: skip


def added_latency(args: argparse.Namespace, tmp: Path) -> None:
    """Interleaved TTFT pairs, direct vs routed, one backend without a prefix cache."""
    # Free ports by default: a fixed one may be another benchmark's server.
    port, router_port = args.port or free_port(), args.router_port or free_port()
    direct, routed = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{router_port}"
    procs = [start(serve_cmd(args, tmp / "base", port, "--no-cache"), direct, tmp / "serve.log")]
    try:
        router_cmd = ["router", "--backend", direct, "--port", str(router_port)]
        procs.append(start(router_cmd, routed, tmp / "router.log"))
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
        stop(procs)
    added = [r - d for d, r in zip(times["direct"], times["router"], strict=True)]
    print(f"model {args.model}, {args.requests} interleaved pairs, max_tokens {args.tokens}")
    print(f"{'path':14} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, values in (*times.items(), ("added (pair)", added)):
        print(
            f"{name:14} {percentile(values, 0.5) * 1e3:8.1f} {percentile(values, 0.99) * 1e3:8.1f}"
            f" {statistics.mean(values) * 1e3:8.1f}"
        )


def affinity(args: argparse.Namespace, tmp: Path) -> None:
    """Two backends with their prefix caches; each long document is sent cold, then
    (after short prompts that move least-loaded routing on) again: where it lands
    and its TTFT."""
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [
        start(serve_cmd(args, tmp / f"base{i}", p), u, tmp / f"serve{i}.log")
        for i, (p, u) in enumerate(zip(ports, urls, strict=True))
    ]
    router_port = free_port()
    routed = f"http://127.0.0.1:{router_port}"
    cold, hit, same = [], [], 0
    try:
        router_cmd = [
            "router",
            "--port",
            str(router_port),
            *(a for u in urls for a in ("--backend", u)),
        ]
        procs.append(start(router_cmd, routed, tmp / "router.log"))
        with httpx.Client(timeout=600) as http:
            for url in urls:
                ttft(http, url, args.model, "warm up", args.tokens)
            for i in range(args.docs):
                doc = f"Document {i}. " + " ".join(
                    f"Line {j} of document {i} says {j * i}." for j in range(150)
                )
                first_s, first_at = ttft_at(http, routed, args.model, doc, args.tokens)
                for k in range(2):
                    ttft(http, routed, args.model, f"Short question {i}.{k}?", args.tokens)
                again_s, again_at = ttft_at(http, routed, args.model, doc, args.tokens)
                cold.append(first_s)
                hit.append(again_s)
                same += again_at == first_at
    finally:
        stop(procs)
    print(f"model {args.model}, {args.docs} long documents over 2 backends")
    print(f"repeats routed to the backend that served the document: {same}/{args.docs}")
    print(f"TTFT median: cold {statistics.median(cold) * 1e3:.1f} ms, "
          f"repeat {statistics.median(hit) * 1e3:.1f} ms")  # fmt: skip


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
