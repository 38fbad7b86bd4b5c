"""What logprobs cost the batch: 8 decoding rows, before and after the logprobs
change, and with one of the 8 rows asking for logprobs (top 5).

    .venv/bin/python benchmarks/bench_logprobs.py [--rounds 5] [--steps 32] [--before REV]

Two worker processes hold SmolLM2 float32 each: one runs the omlx tree of
``--before`` (default: the commit before logprobs, extracted with ``git archive``),
the other this tree. The driver runs timed blocks in interleaved rounds, one
process at a time (the other waits on its pipe): per round, "before" with no row
asking, "after" with no row asking, "after" with one row asking, in a rotating
order. A block: 8 chat prompts prefilled, then ``--steps`` decode steps of the
whole batch timed one by one (the runner's own step: compiled batch step,
sampling, logprobs); a block scores its median step. Reported: the median of
the blocks per mode, and the ratios (of the medians, and round by round).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The commit this branch started from (before logprobs existed).
BEFORE = "f6c0e06"
MODES = ("before", "after", "after+1")


def worker(model_path: str) -> None:
    """Answer "run <asking> <steps>" lines with the seconds per decode step."""
    import mlx.core as mx
    from mlx_lm import load

    from omlx.engine.runner import BatchRunner
    from omlx.scheduler import Request, SamplingParams

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_core import chat_prompt

    model, tokenizer = load(model_path)
    stream = mx.new_stream(mx.default_device())
    runner = BatchRunner(model, prefill_step_size=512, stream=stream)
    runner.prove_compiled()
    for block, line in enumerate(sys.stdin):
        _, asking, steps = line.split()
        requests = []
        for i in range(8):
            kw = {"logprobs": 5} if i < int(asking) else {}
            params = SamplingParams(temperature=0.0, max_tokens=10_000, **kw)
            requests.append(Request(f"b{block}-{i}", tuple(chat_prompt(tokenizer, i)), params))
        runner.add(requests)
        while len(runner.step()) < 8:  # prefill, until every row has its first token
            pass
        stamps, cpu = [time.perf_counter()], time.process_time()
        for _ in range(int(steps)):
            runner.step()
            stamps.append(time.perf_counter())
        cpu_per_step = (time.process_time() - cpu) / int(steps)
        # The block's median step: a shared machine's stalls hit single steps.
        per_step = statistics.median(b - a for a, b in itertools.pairwise(stamps))
        runner.remove([r.request_id for r in requests])
        runner.step()  # the deferred work of the removal
        print("RESULT " + json.dumps([per_step, cpu_per_step]), flush=True)


def spawn(tree: Path, model_path: str, threads: int) -> subprocess.Popen:
    # Few BLAS threads: on a shared machine an oversubscribed thread pool's stalls
    # swamp what is measured.
    n = str(threads)
    env = {**os.environ, "PYTHONPATH": str(tree), "OPENBLAS_NUM_THREADS": n, "OMP_NUM_THREADS": n}
    cmd = [sys.executable, __file__, "--worker", model_path]
    return subprocess.Popen(
        cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def ask(proc: subprocess.Popen, asking: int, steps: int) -> tuple[float, float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"run {asking} {steps}\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("RESULT "):
            wall, cpu = json.loads(line[len("RESULT ") :])
            return float(wall), float(cpu)
    raise RuntimeError("the benchmark worker exited")


def before_tree(rev: str) -> Path:
    """The omlx package as it was at ``rev``, in a temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="omlx-before-"))
    archive = subprocess.run(
        ["git", "archive", rev, "omlx", "benchmarks/bench_core.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, default=Path("~/.omlx/models").expanduser())
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads per worker")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if not (args.model_dir / args.model).exists():
        from omlx.models.builtin import install_default_model

        install_default_model(args.model_dir)
    model_path = str(args.model_dir / args.model)
    procs = {
        "before": spawn(before_tree(args.before), model_path, args.threads),
        "after": spawn(ROOT, model_path, args.threads),
    }
    runs = {
        "before": lambda: ask(procs["before"], 0, args.steps),
        "after": lambda: ask(procs["after"], 0, args.steps),
        "after+1": lambda: ask(procs["after"], 1, args.steps),
    }
    try:
        for mode in MODES:  # warm-up: traces, first-use costs
            runs[mode]()
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:
                times[mode].append(runs[mode]())
    finally:
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=60)
    report(times, args)


def report(times: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> None:
    print(
        f"{args.model}, 8 decoding rows, {args.steps} steps per block, median of "
        f"{args.rounds} interleaved rounds (before = {args.before}, {args.threads} BLAS threads)"
    )
    for k, what in enumerate(("wall ms/step (block median)", "CPU ms/step (process time)")):
        print(what)
        series = {m: [t[k] for t in v] for m, v in times.items()}
        med = {m: statistics.median(v) for m, v in series.items()}
        for mode in MODES:
            ms = " ".join(f"{t * 1000:.1f}" for t in series[mode])
            print(f"  {mode:8} {med[mode] * 1000:7.2f}   blocks: {ms}")
        for name, a, b in (
            ("after / before (no row asks)", "after", "before"),
            ("one row asks / none (after)", "after+1", "after"),
        ):
            rounds = zip(series[a], series[b], strict=True)
            per_round = " ".join(f"{x / y:.3f}" for x, y in rounds)
            print(f"  {name:30} {med[a] / med[b]:.3f}   per round: {per_round}")


if __name__ == "__main__":
    main()
