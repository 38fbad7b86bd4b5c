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
- Drift: mean and max |logprob difference| against full-precision KV, read in one
  forward over (a) the model's own greedy answer to a question, (b) prose it did not
  write (tests/integration/test_kv_quant.py's text).
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
from omlx.memory.dims import guard_dims  # noqa: E402
from omlx.memory.fit import estimate_fit  # noqa: E402
from omlx.models.builtin import install_default_model  # noqa: E402
from omlx.models.model_settings import KVQuantSpec  # noqa: E402
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


def model_for(path: Path, bits: int | None):
    model, tokenizer = load(str(path))
    if bits is not None:
        install(model, KVQuantSpec(bits, 64), path.name)
    return model, tokenizer


def token_logprobs(model, ids: list[int]) -> mx.array:
    from omlx.mlx_types import prompt_cache

    logits = model(mx.array(ids)[None], cache=prompt_cache(model))[0, :-1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(logprobs, mx.array(ids[1:])[:, None], axis=-1)[:, 0]


def drift(path: Path, answer_tokens: int) -> dict:
    full, tokenizer = model_for(path, None)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    answer = [int(t) for t, _ in generate_step(mx.array(prompt), full, max_tokens=answer_tokens)]
    texts = {"answer": (prompt + answer, len(prompt) - 1), "prose": (tokenizer.encode(PROSE), 0)}
    reference = {k: token_logprobs(full, ids)[start:] for k, (ids, start) in texts.items()}
    out: dict = {}
    for bits in (8, 4):
        model, _ = model_for(path, bits)
        for kind, (ids, start) in texts.items():
            d = mx.abs(token_logprobs(model, ids)[start:] - reference[kind])
            out[f"{bits}-bit {kind} ({d.size} tokens)"] = {
                "mean": round(mx.mean(d).item(), 4),
                "max": round(mx.max(d).item(), 3),
            }
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
            kv_quant=None if bits is None else (bits, 64),
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
    args = parser.parse_args()
    path = install_default_model(Path(tempfile.mkdtemp(prefix="bench-kvq-")))
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
        "logprob_drift_vs_full": drift(path, args.answer_tokens),
        "device": mx.default_device().type.name,
    }
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
