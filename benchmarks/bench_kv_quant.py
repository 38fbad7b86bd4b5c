"""A quantized KV cache (a model's ``kv_bits``) against full-precision KV on the built-in
SmolLM2: KV bytes per token, the longest context under a fixed memory ceiling, decode
tokens/s at 1 and 8 streams, and logprob drift.

    .venv/bin/python benchmarks/bench_kv_quant.py [--ceiling-gb 2] [--steps 24] [--rounds 3]

- KV bytes per token: what the model's cache grows by per token (engine/kv_measure.py,
  the guard's figure at load).
- Max context: the fit estimate's longest single-request context (memory/fit.py, the
  guard's arithmetic) under ``--ceiling-gb``, with the measured KV per token.
- Decode: the runner as the server builds it (full precision: compiled steps when the
  model qualifies; quantized: eager), greedy, 1 and 8 chat prompts prefilled, then
  ``--steps`` decode steps timed; the median of ``--rounds`` blocks, in tokens/s.
- Drift: mean and max |logprob difference| against full-precision KV, read as a
  request reads them (the prompt in one forward, then one token per forward) over
  (a) the model's own greedy answer to a question, (b) prose it did not write.
  ``--drift-only``: drift and KV bytes per token at groups of 32, 64 and 128.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omlx.engine.compiled_batch import CompiledSteps  # noqa: E402
from omlx.engine.kv_measure import cache_bytes_per_token  # noqa: E402
from omlx.engine.quantized_cache import install  # noqa: E402
from omlx.engine.runner import BatchRunner  # noqa: E402
from omlx.engine.strategy import ExecutionStrategy  # noqa: E402
from omlx.errors import SettingsError  # noqa: E402
from omlx.memory.dims import guard_dims  # noqa: E402
from omlx.memory.fit import estimate_fit  # noqa: E402
from omlx.models.builtin import install_default_model  # noqa: E402
from omlx.models.model_settings import DEFAULT_KV_GROUP_SIZE, KVQuantSpec  # noqa: E402
from omlx.scheduler import Request, SamplingParams  # noqa: E402

MODES = (None, 8, 4)
QUESTION = "Explain how a canal lock lets a boat climb a hill, step by step."
PROSE = (
    "The river had carried the town's trade for three hundred years before the railway "
    "came. Barges loaded with grain, timber and coal moved slowly past the mills, and the "
    "families who worked the locks knew every boatman by name. When the first train "
    "arrived, the mayor gave a speech about progress, and the children ran along the "
    "platform waving flags. Within a decade most of the barges were gone. The mills "
    "closed one after another, and the warehouses by the water stood empty, their windows "
    "broken and their doors chained. Some people left for the cities, where the factories "
    "paid better wages; others stayed and opened shops near the new station. The old lock "
    "keeper refused to leave his cottage, and every morning he still opened the gates, "
    "although no boat had passed for years."
)
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines train the immune system.",
    "Describe the water cycle for a ten-year-old.",
    "What are the trade-offs of microservices?",
    "Summarise the causes of the First World War.",
    "How does a refrigerator keep food cold?",
    "Give advice for a first marathon.",
    "Why is the sky blue at noon and red at sunset?",
]


def model_for(path: Path, bits: int | None, group_size: int = DEFAULT_KV_GROUP_SIZE):
    model, tokenizer = load(str(path))
    if bits is not None:
        install(model, KVQuantSpec(bits, group_size), path.name)
    return model, tokenizer


def decode_logprobs(model, prompt: list[int], continuation: list[int]) -> mx.array:
    """The logprob of each token of ``continuation`` as a request reads it: the prompt
    in one forward, then one token per forward (a quantized cache attends over its
    quantized K/V from the second forward on: quantized_cache.py)."""
    from omlx.mlx_types import prompt_cache

    cache = prompt_cache(model)
    logits = [model(mx.array(prompt)[None], cache=cache)[0, -1]]
    for token in continuation[:-1]:
        logits.append(model(mx.array([[token]]), cache=cache)[0, -1])
        mx.eval(logits[-1])
    stacked = mx.stack(logits).astype(mx.float32)
    logprobs = stacked - mx.logsumexp(stacked, axis=-1, keepdims=True)
    return mx.take_along_axis(logprobs, mx.array(continuation)[:, None], axis=-1)[:, 0]


def drift_texts(path: Path, answer_tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """(prompt, continuation) pairs: the model's own greedy answer to QUESTION, and
    PROSE it did not write (its first 16 tokens the prompt)."""
    full, tokenizer = model_for(path, None)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    answer = [int(t) for t, _ in generate_step(mx.array(prompt), full, max_tokens=answer_tokens)]
    prose = tokenizer.encode(PROSE)
    return {"answer": (prompt, answer), "prose": (prose[:16], prose[16:])}


def drift(path: Path, answer_tokens: int, group_sizes: tuple[int, ...]) -> dict:
    texts = drift_texts(path, answer_tokens)
    full, _ = model_for(path, None)
    reference = {k: decode_logprobs(full, *pair) for k, pair in texts.items()}
    out: dict = {}
    for group in group_sizes:
        for bits in (8, 4):
            try:
                model, _ = model_for(path, bits, group)
            except SettingsError as exc:  # e.g. groups of 128 on heads of 64
                out[f"{bits}-bit g{group}"] = exc.message
                continue
            for kind, pair in texts.items():
                d = mx.abs(decode_logprobs(model, *pair) - reference[kind])
                key = f"{bits}-bit g{group} {kind} ({d.size} tokens)"
                out[key] = {
                    "mean": round(mx.mean(d).item(), 4),
                    "max": round(mx.max(d).item(), 3),
                    "kv_bytes_per_token": cache_bytes_per_token(model),
                }
                print(key, out[key], file=sys.stderr, flush=True)  # a long run's progress
    return out


def runner_for(model, bits: int | None) -> BatchRunner:
    strategy = ExecutionStrategy.choose("auto", mx.default_device().type.name)
    runner = BatchRunner(
        model,
        prefill_step_size=512,
        stream=mx.new_stream(mx.default_device()),
        strategy=strategy,
        compiled=CompiledSteps() if bits is not None else None,
    )
    runner.prove_compiled()
    return runner


def decode_rate(model, tokenizer, bits: int | None, streams: int, steps: int) -> float:
    """Tokens/s of ``steps`` decode steps once ``streams`` requests are decoding."""
    runner = runner_for(model, bits)
    requests = [
        Request(
            f"r{i}",
            tuple(tokenizer.apply_chat_template([{"role": "user", "content": p}])),
            SamplingParams(temperature=0.0, max_tokens=10_000),
        )
        for i, p in enumerate(PROMPTS[:streams])
    ]
    runner.add(requests)
    seen: set[str] = set()
    while len(seen) < streams:  # every prompt in, its first token out
        seen.update(t.request_id for t in runner.step())
    runner.step()
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += len(runner.step())
    return tokens / (time.perf_counter() - start)


def capacity(path: Path, ceiling: int) -> dict:
    """The fit estimate's longest context for one request under ``ceiling`` (float32
    KV, as the model runs on the CPU backend)."""
    config = json.loads((path / "config.json").read_text())
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    dims = guard_dims(config, kv_dtype_bytes=4, model=path.name)
    out = {}
    for bits in MODES:
        fit = estimate_fit(
            {**config, "torch_dtype": "float32"},
            weights,
            limit_bytes=ceiling,
            concurrency=1,
            context_tokens=10_000_000,
            kv_quant=None if bits is None else (bits, DEFAULT_KV_GROUP_SIZE),
        )
        out[label(bits)] = fit.max_context_tokens
    out["config KV B/token (full)"] = dims.kv_bytes_per_token
    return out


def label(bits: int | None) -> str:
    return "full" if bits is None else f"{bits}-bit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ceiling-gb", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--answer-tokens", type=int, default=160)
    parser.add_argument(
        "--drift-only", action="store_true", help="drift and bytes at groups 32/64/128"
    )
    args = parser.parse_args()
    path = install_default_model(Path(tempfile.mkdtemp(prefix="bench-kvq-")))
    if args.drift_only:
        print(json.dumps(drift(path, args.answer_tokens, (32, 64, 128)), indent=2))
        return
    per_token, rates = {}, {}
    for bits in MODES:
        model, tokenizer = model_for(path, bits)
        per_token[bits] = cache_bytes_per_token(model)
        for streams in (1, 8):
            runs = [
                decode_rate(model, tokenizer, bits, streams, args.steps) for _ in range(args.rounds)
            ]
            rates[f"{label(bits)}, {streams} stream(s)"] = round(statistics.median(runs), 1)
    full = per_token[None]
    report = {
        "kv_bytes_per_token": {label(b): f"{n} ({n / full:.3f}x)" for b, n in per_token.items()},
        f"max_context_tokens_under_{args.ceiling_gb:g}GB": capacity(
            path, int(args.ceiling_gb * 1e9)
        ),
        "decode_tokens_per_s": rates,
        "logprob_drift_vs_full": drift(path, args.answer_tokens, (DEFAULT_KV_GROUP_SIZE,)),
        "device": mx.default_device().type.name,
    }
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
