"""In-process check of a runner refactor: the same requests through ``BatchRunner.add`` /
``step`` on SmolLM2-135M (float32, the CPU's fast paths), printing per scenario the steps,
the batch's decode forwards, a digest of every request's greedy tokens, the wall time and
the time to the first token. Two trees give the same forwards and digests when the change
preserves behaviour; ``PYTHONPATH`` picks the tree (``git archive REV omlx | tar -x -C DIR``
for an older one). Run each tree in turn, interleaved:

    M=/tmp/omlx-peers/base/models/SmolLM2-135M-Instruct  # benchmarks/peers imports it
    for i in 1 2 3; do for tree in /tmp/base .; do
        PYTHONPATH=$tree .venv/bin/python benchmarks/runner_ab.py $M; done; done
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import mlx.core as mx
from mlx_lm import load

from omlx.engine.runner import BatchRunner
from omlx.engine.strategy import ExecutionStrategy
from omlx.scheduler import Request, SamplingParams

TOKENS = 64


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=TOKENS))


def prompt(i: int, n: int) -> list[int]:
    return [(97 * k + 31 * i) % 40000 + 100 for k in range(n)]


def drive(model, waves: dict[int, list[Request]]) -> dict[str, object]:
    """Start each wave at its step; run until every request has ``TOKENS`` tokens."""
    runner = BatchRunner(
        model,
        prefill_step_size=512,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.choose("auto", "cpu"),
    )
    runner.prove_compiled()
    got: dict[str, list[int]] = {}
    wanted = {r.request_id for rs in waves.values() for r in rs}
    steps, first, start = 0, 0.0, time.perf_counter()
    while wanted and steps < 1000:
        if steps in waves:
            runner.add(waves[steps])
        for t in runner.step():
            got.setdefault(t.request_id, []).append(t.token_id)
            first = first or time.perf_counter() - start
        done = [rid for rid in wanted if len(got.get(rid, ())) >= TOKENS]
        runner.remove(done)
        wanted -= set(done)
        steps += 1
    wall = time.perf_counter() - start
    runner.close()
    tokens = json.dumps(sorted((rid, t[:TOKENS]) for rid, t in got.items()))
    return {
        "steps": steps,
        "decode_forwards": runner.num_decode_steps,
        "digest": hashlib.sha1(tokens.encode()).hexdigest()[:12],
        "wall_s": round(wall, 2),
        "first_token_s": round(first, 3),
    }


def main() -> None:
    model, _ = load(sys.argv[1])
    eight = [request(f"r{i}", prompt(i, 60 + 20 * i)) for i in range(8)]
    joining = [request(f"b{i}", prompt(i + 1, 80)) for i in range(3)]
    out = {
        "8 concurrent": drive(model, {0: eight}),
        "lone, 3 join at step 10": drive(model, {0: [request("a", prompt(0, 300))], 10: joining}),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
