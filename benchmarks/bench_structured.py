"""Structured-output benchmark: decode speed under a JSON schema vs free text.

    .venv/bin/python benchmarks/bench_structured.py [--repeats 3] [--tokens 128]

SmolLM2 float32 through ``omlx serve``: single-stream decode tok/s and aggregate
tok/s with 8 concurrent clients, each with and without a JSON-schema constraint,
in interleaved pairs (median reported). The schema is an array of at least 64
short strings, so the grammar is still open after ``--tokens`` tokens and both
sides decode the same number of tokens. Also: grammar compile time for a typical
schema, first and cached, and the one-time TokenizerInfo build.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_core import start_server, stream_one

LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[^@]+@[^@]+$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
        },
    },
    "required": ["name", "age"],
}
CONSTRAINED = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "list", "schema": LONG_SCHEMA},
    }
}


async def rate(http: httpx.AsyncClient, model: str, n: int, tokens: int, extra: dict) -> float:
    start = time.perf_counter()
    runs = await asyncio.gather(*(stream_one(http, model, i, tokens, extra) for i in range(n)))
    if n == 1:
        stamps = runs[0]["stamps"]
        return (runs[0]["tokens"] - 1) / (stamps[-1] - stamps[0])
    return sum(r["tokens"] for r in runs) / (time.perf_counter() - start)


async def compare(url: str, model: str, tokens: int, repeats: int) -> dict[int, list]:
    pairs: dict[int, list[tuple[float, float]]] = {1: [], 8: []}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await stream_one(http, model, 0, 8, CONSTRAINED)  # load, compile, warm up
        for _ in range(repeats):
            for n in pairs:
                free = await rate(http, model, n, tokens, {})
                constrained = await rate(http, model, n, tokens, CONSTRAINED)
                pairs[n].append((free, constrained))
    return pairs


def compile_times(model_path: Path) -> tuple[float, float, float]:
    from mlx_lm import load

    from omlx.engine.model_engine import _hf_tokenizer
    from omlx.grammar.compiler import GrammarCompiler
    from omlx.grammar.spec import GrammarSpec

    _, tokenizer = load(str(model_path))
    start = time.perf_counter()
    compiler = GrammarCompiler(_hf_tokenizer(tokenizer), 49152, {2})
    info_s = time.perf_counter() - start
    spec = GrammarSpec.json_schema(TYPICAL_SCHEMA, strict=True, param="bench")
    start = time.perf_counter()
    compiler.compile(spec)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(spec)
    return info_s, first_s, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, default=Path("~/.omlx/models").expanduser())
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="omlx-bench-log-")) / "server.log"
    proc, _ = start_server(args.model_dir, args.port, log)
    try:
        pairs = asyncio.run(
            compare(f"http://127.0.0.1:{args.port}", args.model, args.tokens, args.repeats)
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"model {args.model}, {args.tokens} tokens, median of {args.repeats} pairs")
    print(f"{'clients':>8} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>7}  target 0.90")
    for n, runs in pairs.items():
        free = statistics.median(p[0] for p in runs)
        constrained = statistics.median(p[1] for p in runs)
        ratios = " ".join(f"{c / f:.2f}" for f, c in runs)
        flag = "ok" if constrained / free >= 0.9 else "MISS"
        print(
            f"{n:8d} {free:11.1f} {constrained:13.1f} {constrained / free:7.2f}  {flag:4}"
            f"  pairs: {ratios}"
        )
    info_s, first_s, cached_s = compile_times(args.model_dir / args.model)
    print(f"TokenizerInfo (once per model): {info_s * 1000:.0f} ms")
    print(f"compile typical schema: first {first_s * 1000:.1f} ms, cached {cached_s * 1e6:.0f} us")


if __name__ == "__main__":
    main()
