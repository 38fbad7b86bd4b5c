"""Cold prefill in process by chunk size: omlx's ``SoloSequence`` (how a lone request
prefills in the server) and mlx-lm's ``stream_generate``, each at prefill steps of 512
(omlx's default) and 2048 (mlx-lm's), on one agent's first prompt, rounds rotating.

    .venv/bin/python benchmarks/agent_traffic/prefill_steps.py --tool opencode --rounds 1

Same model as cold_prefill.py (the replay's ``--shape small``), a new nonce per prompt;
the time is the prompt in, first token out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx_lm import load, stream_generate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from benchmarks.agent_traffic.cold_prefill import first_prompt, with_nonce  # noqa: E402
from omlx.engine.solo import SoloSequence  # noqa: E402

MODEL_DIR = "/tmp/omlx-peers/agent-models-small-65536/SmolLM2-135M-Instruct"  # cold_prefill's


def sides(model, tokenizer) -> dict[str, Callable[[list[int]], None]]:
    def omlx(step: int) -> Callable[[list[int]], None]:
        def run(ids: list[int]) -> None:
            seq = SoloSequence(model, "r", ids, lambda x: mx.argmax(x, -1), [], step)
            while seq.step() is None:
                pass

        return run

    def mlx_lm(step: int) -> Callable[[list[int]], None]:
        def run(ids: list[int]) -> None:
            for _ in stream_generate(model, tokenizer, ids, max_tokens=1, prefill_step_size=step):
                break

        return run

    return {"omlx 512": omlx(512), "omlx 2048": omlx(2048), "mlx-lm 2048": mlx_lm(2048),
            "mlx-lm 512": mlx_lm(512)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", default="opencode")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    model, tokenizer = load(MODEL_DIR)
    body, runs = first_prompt(args.tool), sides(model, tokenizer)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(args.rounds):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            messages = with_nonce(body, uuid.uuid4().hex)["messages"]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            mx.clear_cache()
            started = time.perf_counter()
            runs[name](ids)
            times[name].append(time.perf_counter() - started)
            print(f"round {rnd} {name}: {len(ids)} tokens, {times[name][-1]:.2f} s", flush=True)
    base = times["mlx-lm 2048"]
    for name, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"{name}: {' '.join(f'{v:.2f}' for v in values)} s, / mlx-lm 2048: {ratio:.3f}")


if __name__ == "__main__":
    main()
