"""Server-core benchmark: omlx over HTTP vs raw mlx-lm on the same model, one run.

    .venv/bin/python benchmarks/bench_core.py [--model-dir DIR] [--tokens 128]

Measures, with temperature 0 and ``ignore_eos`` so every run makes the same
number of tokens:
  - raw mlx-lm ``generate_step`` (the loop inside ``stream_generate``) decode
    tok/s vs omlx single-stream HTTP decode tok/s (first to last streamed token);
  - raw ``BatchGenerator`` aggregate tok/s at batch 8 and 16 vs omlx with 8 and 16
    concurrent streaming clients (completion tokens / wall time, prefill included
    on both sides);
  - time from ``omlx serve`` start to ``/health`` 200, model load time, and the
    server's peak RSS (VmHWM).
The raw runs happen in this process before the server starts, never at the
same time, so both sides get the whole machine. Each number is the median of
``--repeats`` runs (this 2-core machine varies by +-15% from run to run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
]


def chat_prompt(tokenizer, i: int) -> list[int]:
    messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def raw_single(model, tokenizer, tokens: int) -> float:
    """mlx-lm's own decode loop (``generate_step``, what ``stream_generate`` runs),
    for exactly ``tokens`` tokens like the server run (which ignores EOS), rated
    the same way: (tokens - 1) / (last token time - first token time)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    stamps = []
    for _ in generate_step(mx.array(chat_prompt(tokenizer, 0)), model, max_tokens=tokens):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def raw_batch(model, tokenizer, n: int, tokens: int) -> float:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=n, prefill_batch_size=n)
    prompts = [chat_prompt(tokenizer, i) for i in range(n)]
    start = time.perf_counter()
    gen.insert(prompts, max_tokens=[tokens] * n)
    produced, done = 0, 0
    while done < n:
        for response in gen.next_generated():
            produced += 1
            done += response.finish_reason is not None
    elapsed = time.perf_counter() - start
    gen.close()
    return produced / elapsed


async def stream_one(
    http: httpx.AsyncClient, model: str, i: int, tokens: int, extra: dict | None = None
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    stamps, usage = [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return {"stamps": stamps, "tokens": usage["completion_tokens"]}


async def http_single(http: httpx.AsyncClient, model: str, tokens: int) -> float:
    solo = await stream_one(http, model, 0, tokens)
    # Detokenized chunks can merge tokens; the rate uses the token count.
    return (solo["tokens"] - 1) / (solo["stamps"][-1] - solo["stamps"][0])


async def http_aggregate(http: httpx.AsyncClient, model: str, n: int, tokens: int) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_one(http, model, i, tokens) for i in range(n)))
    return sum(r["tokens"] for r in results) / (time.perf_counter() - start)


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(model_dir: Path, port: int, log: Path) -> tuple[subprocess.Popen, float]:
    """Start ``omlx serve``; returns the process and seconds until /health answered."""
    base = Path(tempfile.mkdtemp(prefix="omlx-bench-"))
    cmd = [
        sys.executable,
        "-m",
        "omlx.cli",
        "--base-path",
        str(base),
        "serve",
        "--model-dir",
        str(model_dir),
        "--port",
        str(port),
        "--max-concurrent-requests",
        "16",
        "--no-install-default",
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=log.open("w"))
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - start
        except httpx.TransportError:
            if proc.poll() is not None:
                raise SystemExit(f"omlx serve exited: {log.read_text()[-2000:]}") from None
            time.sleep(0.01)


async def compare(args: argparse.Namespace, url: str) -> dict[str, list[tuple[float, float]]]:
    """(mlx-lm, omlx) pairs per metric; each pair runs back to back, never together."""
    from mlx_lm import load

    model, tokenizer = load(str(args.model_dir / args.model))
    pairs: dict[str, list[tuple[float, float]]] = {"single": [], "batch8": [], "batch16": []}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await stream_one(http, args.model, 0, 8)  # load + warm up
        raw_single(model, tokenizer, 8)
        for _ in range(args.repeats):
            pairs["single"].append(
                (
                    raw_single(model, tokenizer, args.tokens),
                    await http_single(http, args.model, args.tokens),
                )
            )
            for n in (8, 16):
                pairs[f"batch{n}"].append(
                    (
                        raw_batch(model, tokenizer, n, args.tokens),
                        await http_aggregate(http, args.model, n, args.tokens),
                    )
                )
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, default=Path("~/.omlx/models").expanduser())
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many pairs")
    args = parser.parse_args()
    if not (args.model_dir / args.model).exists():
        from omlx.models.builtin import install_default_model

        install_default_model(args.model_dir)
    log = Path(tempfile.mkdtemp(prefix="omlx-bench-log-")) / "server.log"
    proc, ready_s = start_server(args.model_dir, args.port, log)
    try:
        pairs = asyncio.run(compare(args, f"http://127.0.0.1:{args.port}"))
        peak_rss_mb = vm_hwm_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    match = re.search(r"loaded \S+ .* in ([0-9.]+) s", log.read_text())
    targets = {
        "single": ("single stream decode tok/s", 0.95),
        "batch8": ("aggregate tok/s, 8 concurrent", 0.90),
        "batch16": ("aggregate tok/s, 16 concurrent", 0.90),
    }
    print(
        f"model {args.model}, {args.tokens} tokens per request, median of {args.repeats} "
        f"interleaved pairs, python {sys.version.split()[0]}"
    )
    print(f"{'metric':34} {'mlx-lm':>9} {'omlx':>9} {'ratio':>7} {'target':>7}  ratios")
    for key, (name, target) in targets.items():
        base = statistics.median(p[0] for p in pairs[key])
        ours = statistics.median(p[1] for p in pairs[key])
        ratios = " ".join(f"{o / b:.2f}" for b, o in pairs[key])
        flag = "ok" if ours / base >= target else "MISS"
        print(
            f"{name:34} {base:9.1f} {ours:9.1f} {ours / base:7.2f} {target:>6.2f} {flag:4} "
            f" {ratios}"
        )
    print(f"serve start -> /health 200: {ready_s:.2f} s")
    print(f"model load: {float(match.group(1)) if match else float('nan'):.2f} s")
    print(f"server peak RSS: {peak_rss_mb:.0f} MB")


if __name__ == "__main__":
    main()
