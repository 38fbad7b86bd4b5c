"""What counting mlx-lm's cache growth step costs admission: rows run together under a
fixed memory ceiling, with the guard counting each row's KV up to one growth step
(256 columns) beyond its tokens against counting its tokens only (padding and the
step's own token included either way: the count before the growth step was priced,
run by handing the scheduler a step of 1). Alternate rounds swap the order.

    .venv/bin/python benchmarks/bench_kv_rows.py [--room-mb 60 120] [--rounds 2]

In process, on the tests' slow-llama (8 layers, float32 KV: 16 KiB a token), the MLX
reading only (the process footprint of Python is noise next to a tiny model). The
hard limit is the loaded model's MLX memory + the 64 MB margin + ``--room-mb``. The
workload arrives at once: two 1024-token prompts and six 32-token chats, 48 tokens
each. Reported per count: the most requests running at once, memory deferrals, the
wall time, and MLX's peak against the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import omlx.engine.assembly as assembly  # noqa: E402
from omlx.engine.pool import EnginePool  # noqa: E402
from omlx.engine.worker import MLXWorker  # noqa: E402
from omlx.memory.budget import Limits  # noqa: E402
from omlx.settings import Settings  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model  # noqa: E402
from tests.integration.test_memory_admission import MARGIN, MB, MLXProbe, generate  # noqa: E402

MEASURED_STEP = assembly.cache_step


async def workload(pool: EnginePool, room: int) -> dict[str, Any]:
    probe = pool.probe = MLXProbe()
    engine = await pool.get_engine("slow-llama")
    hard = probe.reading(fresh=True).resident_bytes + MARGIN + room
    pool.limits = Limits(hard, hard, MARGIN)
    engine.guard.publish(pool.limits)
    most = 0
    execute = engine._runner.execute

    def spy(plan: Any) -> Any:
        nonlocal most
        most = max(most, engine._scheduler.num_running)
        return execute(plan)

    engine._runner.execute = spy
    longs = [[5 + (i * 7 + j) % 400 for j in range(1024)] for i in range(2)]
    shorts = [[7 + i + j for j in range(32)] for i in range(6)]
    probe.max_peak = 0
    start = time.perf_counter()
    results = await asyncio.gather(
        *(generate(engine, f"r{i}", p, max_tokens=48) for i, p in enumerate(longs + shorts))
    )
    wall = time.perf_counter() - start
    probe.reading(fresh=True)
    return {
        "completed": sum(r[0] in ("stop", "length") for r in results),
        "most_running": most,
        "deferrals": engine.gate.deferrals["memory"] + engine.gate.deferrals["kv_capacity"],
        "wall_s": round(wall, 2),
        "peak_over_limit": round(probe.max_peak / hard, 3),
    }


def run(models: Path, base: Path, room: int, step: int | None) -> dict[str, Any]:
    assembly.cache_step = MEASURED_STEP if step is None else (lambda model: step)
    worker = MLXWorker()
    worker.start()
    settings = Settings(
        base_path=base,
        models={"model_dirs": [models]},
        scheduler={"max_concurrent_requests": 8, "prefill_step_size": 512},
        cache={"enabled": False},
        memory={"max_kv_tokens": 65536},  # pinned high: the hard limit decides
    )
    pool = EnginePool(settings, worker, time.monotonic)
    try:
        return asyncio.run(workload(pool, room))
    finally:
        asyncio.run(pool.close())
        worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--room-mb", type=int, nargs="+", default=[60, 120])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        build_tiny_model(models / "slow-llama", "slow-llama", seed=2)
        counts = [("tokens + padding", 1), ("+ growth step", None)]
        for r in range(args.rounds):
            for room in args.room_mb:
                for label, step in counts if r % 2 == 0 else counts[::-1]:
                    base = Path(tmp) / f"base-{r}-{room}-{step}"
                    got = run(models, base, room * MB, step)
                    print(f"room {room} MB, {label}: {got}", flush=True)


if __name__ == "__main__":
    main()
