"""Server-core benchmark: omlx over HTTP vs raw mlx-lm on the same model, one run.

    .venv/bin/python benchmarks/bench_core.py [--model-dir DIR] [--tokens 128]

Measures, with temperature 0 and ``ignore_eos`` so every run makes the same
number of tokens:
  - raw ``mlx_lm.stream_generate`` decode tok/s vs omlx single-stream HTTP decode
    tok/s (first to last streamed token);
  - raw ``BatchGenerator`` aggregate tok/s at batch 8 and 16 vs omlx with 8 and 16
    concurrent streaming clients (completion tokens / wall time, prefill included
    on both sides);
  - time from ``omlx serve`` start to ``/health`` 200, model load time, and the
    server's peak RSS (VmHWM).
The raw runs happen in this process before the server starts, never at the
same time, so both sides get the whole machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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
    from mlx_lm import stream_generate

    response = None
    for response in stream_generate(  # noqa: B007 (the last response holds the stats)
        model, tokenizer, chat_prompt(tokenizer, 0), max_tokens=tokens
    ):
        pass
    return response.generation_tps


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


def measure_raw(model_path: Path, tokens: int) -> dict[str, float]:
    from mlx_lm import load

    model, tokenizer = load(str(model_path))
    raw_single(model, tokenizer, 8)  # warm up
    return {
        "single": raw_single(model, tokenizer, tokens),
        "batch8": raw_batch(model, tokenizer, 8, tokens),
        "batch16": raw_batch(model, tokenizer, 16, tokens),
    }


async def stream_one(http: httpx.AsyncClient, model: str, i: int, tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
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


async def measure_http(base_url: str, model: str, tokens: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await stream_one(http, model, 0, 8)  # load + warm up
        solo = await stream_one(http, model, 0, tokens)
        # Detokenized chunks can merge tokens; the rate uses the token count.
        single = (solo["tokens"] - 1) / (solo["stamps"][-1] - solo["stamps"][0])
        out = {"single": single}
        for n in (8, 16):
            start = time.perf_counter()
            results = await asyncio.gather(*(stream_one(http, model, i, tokens) for i in range(n)))
            elapsed = time.perf_counter() - start
            out[f"batch{n}"] = sum(r["tokens"] for r in results) / elapsed
    return out


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_server(model_dir: Path, model: str, tokens: int, port: int) -> dict[str, float]:
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
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.01)
        ready_s = time.perf_counter() - start
        results = asyncio.run(measure_http(url, model, tokens))
        results["startup_s"] = ready_s
        results["peak_rss_mb"] = vm_hwm_mb(proc.pid)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    match = re.search(r"loaded \S+ .* in ([0-9.]+) s", err)
    results["load_s"] = float(match.group(1)) if match else float("nan")
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, default=Path("~/.omlx/models").expanduser())
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    model_path = args.model_dir / args.model
    if not model_path.exists():
        from omlx.models.builtin import install_default_model

        install_default_model(args.model_dir)
    raw = measure_raw(model_path, args.tokens)
    srv = run_server(args.model_dir, args.model, args.tokens, args.port)
    rows = [
        ("single stream decode tok/s", raw["single"], srv["single"], 0.95),
        ("aggregate tok/s, 8 concurrent", raw["batch8"], srv["batch8"], 0.90),
        ("aggregate tok/s, 16 concurrent", raw["batch16"], srv["batch16"], 0.90),
    ]
    print(
        f"model {args.model}, {args.tokens} tokens per request, "
        f"python {sys.version.split()[0]}, pid {os.getpid()}"
    )
    print(f"{'metric':34} {'mlx-lm':>9} {'omlx':>9} {'ratio':>7} {'target':>7}")
    for name, base, ours, target in rows:
        flag = "ok" if ours / base >= target else "MISS"
        print(f"{name:34} {base:9.1f} {ours:9.1f} {ours / base:7.2f} {target:>6.2f} {flag}")
    print(f"serve start -> /health 200: {srv['startup_s']:.2f} s")
    print(f"model load: {srv['load_s']:.2f} s")
    print(f"server peak RSS: {srv['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
