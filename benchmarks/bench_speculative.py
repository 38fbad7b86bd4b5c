"""Speculative decoding (prompt lookup, or a draft model) on an edit workload: the
built-in SmolLM2 is given a ~250-token Python file and asked to return it with one
change, greedy.

    .venv/bin/python benchmarks/bench_speculative.py [--rounds 3] [--draft 4] [--streams 8]
        [--method ngram|draft] [--draft-model NAME]
    .venv/bin/python benchmarks/bench_speculative.py --forward-costs [--rounds 10]

``--method draft`` drafts with ``--draft-model`` (a folder in ``--model-dir``; default:
the model itself, which keeps nearly every draft but costs as much as the model).

One process, one runner (the server's ``BatchRunner``, compiled steps proven as
at model load). Per round, in alternating order: the edit request alone with
speculation off and on, then ``--streams`` edit requests at once (a different
change each) off and on. A request ends at its end-of-sequence token or at
``--max-tokens``. Decode tok/s counts the tokens after each request's first one
over the time from the first token out to the last (prefill excluded); the text
with speculation on must be the text without it, token for token. Reported: the
median tok/s per mode, the on/off ratio (of the medians, and round by round),
the acceptance rate (drafts kept / drafted) and tokens per request and step.

``--forward-costs``: what a speculative step pays instead. The edit prompts are
prefilled as one batch of 1, 2, 4 and 8 rows; per round, interleaved, the
compiled decode step (one token per row) and the compiled verification forward
of 2, 3, 5 and 9 tokens per row, and mlx-lm's eager forward of 5 (cache
trimmed back after each), each evaluated and timed alone; reported: the median
time of each as a multiple of the one-token step's at the same rows.

``--verify-positions 64``: the GPU's budget of verified positions on this CPU (8
streams draft 4 each, as on a Mac): the runner steps each mode takes (reported
beside tok/s) carry over to Metal, where such a step costs about one plain step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

CODE = """import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    count: int


def load_items(path):
    with open(path) as f:
        data = json.load(f)
    return [Item(d["name"], d["price"], d["count"]) for d in data]


def total(items):
    result = 0
    for item in items:
        result += item.price * item.count
    return result


def average_price(items):
    if not items:
        return 0
    return total(items) / len(items)


def most_expensive(items):
    best = None
    for item in items:
        if best is None or item.price > best.price:
            best = item
    return best


def save_report(items, path):
    report = {
        "total": total(items),
        "average": average_price(items),
        "top": most_expensive(items).name,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
"""

CHANGES = [
    "Rename the function `total` to `grand_total` everywhere in this file.",
    "Change `result = 0` to `result = 0.0` in `total`.",
    "Make `average_price` return `0.0` instead of `0` for an empty list.",
    "Add a `sku: str` field to `Item`, after `name`.",
    "Use `indent=4` instead of `indent=2` in `save_report`.",
    "Rename the parameter `path` of `load_items` to `filename`.",
    "Rename the local variable `best` in `most_expensive` to `top_item`.",
    "Change the report key `top` to `most_expensive` in `save_report`.",
]
SYSTEM = (
    "You are a careful code editor. Reply with the complete updated file in one Python "
    "code block, changing only what you are asked to."
)


def edit_prompt(tokenizer: Any, i: int) -> list[int]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"```python\n{CODE}```\n\n{CHANGES[i % len(CHANGES)]} "
            "Return the whole file.",
        },
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def generate(runner: Any, prompts: list[list[int]], max_tokens: int, eos: set[int], tag: str):
    """Every request's tokens and its (first token time, last token time)."""
    from omlx.scheduler import Request, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    runner.add([Request(rid, tuple(p), params) for rid, p in zip(ids, prompts, strict=True)])
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    live = set(ids)
    steps = 0
    while live:
        outputs = runner.step()
        steps += 1
        now = time.perf_counter()
        done = set()
        for out in outputs:
            rid = out.request_id
            if rid not in live or rid in done:
                continue
            tokens[rid].append(out.token_id)
            stamps[rid].append(now)
            if out.token_id in eos or len(tokens[rid]) >= max_tokens:
                done.add(rid)
        if done:
            runner.remove(done)
            live -= done
    runner.step()  # the deferred work of the removals
    return tokens, {rid: (s[0], s[-1]) for rid, s in stamps.items()}, steps


def decode_rate(tokens: dict[str, list[int]], spans: dict[str, tuple[float, float]]) -> float:
    """Tokens after each first one, over the time from the first first token to the
    last last token (all streams together)."""
    start = max(first for first, _ in spans.values()) if len(spans) == 1 else None
    start = start if start is not None else min(first for first, _ in spans.values())
    end = max(last for _, last in spans.values())
    return sum(len(t) - 1 for t in tokens.values()) / max(end - start, 1e-9)


def run_mode(runner: Any, prompts: list[list[int]], num_draft: int, args, eos, tag: str):
    runner.num_draft = num_draft
    before = runner.speculative_stats()
    tokens, spans, steps = generate(runner, prompts, args.max_tokens, eos, tag)
    after = runner.speculative_stats()
    delta = {k: after[k] - before[k] for k in after}
    delta["runner_steps"] = steps
    return decode_rate(tokens, spans), tokens, delta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, default=Path("~/.omlx/models").expanduser())
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft", type=int, default=4, help="tokens drafted per step")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--only", choices=["single", "multi"], help="run one workload")
    parser.add_argument("--forward-costs", action="store_true", help="time the forwards only")
    parser.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    parser.add_argument("--draft-model", help="--method draft: its folder (default: --model)")
    parser.add_argument(
        "--verify-positions",
        type=int,
        help="positions a speculative forward may verify (default: the backend's; 64 is "
        "the GPU's, to count the steps a Mac would take)",
    )
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm import load

    from omlx.engine import batch
    from omlx.engine.runner import BatchRunner

    if args.verify_positions:
        batch.VERIFY_POSITIONS["cpu"] = batch.VERIFY_POSITIONS["gpu"] = args.verify_positions

    if not (args.model_dir / args.model).exists():
        from omlx.models.builtin import install_default_model

        install_default_model(args.model_dir)
    model, tokenizer = load(str(args.model_dir / args.model))
    eos = set(tokenizer.eos_token_ids) if hasattr(tokenizer, "eos_token_ids") else set()
    eos.add(tokenizer.eos_token_id)
    runner = BatchRunner(model, prefill_step_size=512, stream=mx.new_stream(mx.default_device()))
    runner.prove_compiled()
    if args.method == "draft":
        draft = load(str(args.model_dir / (args.draft_model or args.model)))[0]
        runner.set_draft(draft, model.args.vocab_size)
    if args.forward_costs:
        forward_costs(model, [edit_prompt(tokenizer, i) for i in range(8)], args.rounds)
        return
    workloads = {
        "1 stream": [edit_prompt(tokenizer, 0)],
        f"{args.streams} streams": [edit_prompt(tokenizer, i) for i in range(args.streams)],
    }
    print(f"prompt tokens: {[len(p) for p in workloads[f'{args.streams} streams']]}")
    if args.only:
        del workloads[f"{args.streams} streams" if args.only == "single" else "1 stream"]
    rates: dict[tuple[str, str], list[float]] = {}
    steps: dict[tuple[str, str], list[int]] = {}
    stats: dict[str, dict[str, int]] = {}
    texts: dict[tuple[str, str], dict[str, list[int]]] = {}
    for name, prompts in workloads.items():  # traces and kernel builds: first-use costs
        for k in (0, args.draft):
            run_mode(runner, prompts, k, args, eos, f"warm{name}{k}")
    for r in range(args.rounds):
        for name, prompts in workloads.items():
            order = [("off", 0), (args.method, args.draft)]
            for mode, k in order if r % 2 == 0 else order[::-1]:
                rate, tokens, delta = run_mode(runner, prompts, k, args, eos, f"{r}{name}{mode}")
                rates.setdefault((name, mode), []).append(rate)
                steps.setdefault((name, mode), []).append(delta["runner_steps"])
                if k:
                    acc = stats.setdefault(name, dict.fromkeys(delta, 0))
                    for key, v in delta.items():
                        acc[key] += v
                plain = {rid.split("-")[-1]: t for rid, t in tokens.items()}
                same = texts.setdefault((name, "text"), plain)
                assert same == plain, f"{name} {mode}: the text changed"
    report(rates, steps, stats, texts, args)


def forward_costs(model: Any, prompts: list[list[int]], rounds: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from omlx.engine.batch import merge_caches
    from omlx.engine.compiled_batch import CompiledBatchStep

    step = CompiledBatchStep(model)
    assert step.prove()
    widths = (2, 3, 5, 9)

    def timed(rows: int, width: int, cache: list[Any], eager: bool = False) -> float:
        tokens = mx.array([prompts[r][-width:] for r in range(rows)])
        start = time.perf_counter()
        if eager:
            logits = model(tokens, cache=cache)
        else:
            logits = step(tokens[:, 0], cache) if width == 1 else step.verify(tokens, cache)
        mx.eval(logits)
        took = time.perf_counter() - start
        for layer in cache:
            layer.trim(width)
        return took

    print(f"context ~{len(prompts[0])} tokens; time per forward / the 1-token step's, median")
    for rows in (1, 2, 4, 8):
        caches = []
        for prompt in prompts[:rows]:
            caches.append(make_prompt_cache(model))
            mx.eval(model(mx.array(prompt)[None], cache=caches[-1]))
        cache = merge_caches(caches)
        times: dict[int, list[float]] = {}
        for r in range(rounds + 1):  # round 0 traces each shape
            for width in (1, *widths, -5):  # -5: mlx-lm's eager forward of 5
                took = timed(rows, abs(width), cache, eager=width < 0)
                if r:
                    times.setdefault(width, []).append(took)
        one = statistics.median(times[1])
        costs = "  ".join(f"{w}: {statistics.median(times[w]) / one:.2f}x" for w in widths)
        eager = statistics.median(times[-5]) / one
        print(f"  {rows} rows: 1 token {one * 1000:.1f} ms  {costs}  (5 eagerly: {eager:.2f}x)")


def report(rates, steps, stats, texts, args) -> None:
    print(
        f"{args.model}, greedy, edit workload, --method {args.method} "
        f"{args.draft_model or ''} --draft {args.draft}, "
        f"median of {args.rounds} interleaved rounds"
    )
    for name in sorted({name for name, _ in rates}):
        off, on = rates[(name, "off")], rates[(name, args.method)]
        per_round = " ".join(f"{b / a:.2f}" for a, b in zip(off, on, strict=True))
        s = stats[name]
        acceptance = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        per_step = s["tokens"] / s["row_steps"] if s["row_steps"] else 1.0
        print(
            f"  {name:10} off {statistics.median(off):6.1f} tok/s  {args.method} "
            f"{statistics.median(on):6.1f} tok/s  ratio "
            f"{statistics.median(on) / statistics.median(off):.2f} (per round: {per_round})  "
            f"acceptance {acceptance:.2f}  tokens/step {per_step:.2f}  runner steps "
            f"{statistics.median(steps[(name, 'off')]):.0f} -> "
            f"{statistics.median(steps[(name, args.method)]):.0f}"
        )
    n = sum(len(t) for (_, kind), v in texts.items() for t in v.values())
    print(f"  same text with and without drafts: yes ({n} tokens per mode and round)")


if __name__ == "__main__":
    main()
