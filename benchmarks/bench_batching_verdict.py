"""A warm load with the batching verdict kept (batching_verdict.py) against one that
probes again: the built-in SmolLM2 loaded in-process on one base path, the profile
reused both times; interleaved, medians.

    .venv/bin/python benchmarks/bench_batching_verdict.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omlx.engine.pool import EnginePool
from omlx.engine.worker import MLXWorker
from omlx.models.builtin import BUILTIN_MODEL_NAME, install_default_model
from omlx.settings import Settings


def load_seconds(base: Path, models: Path) -> float:
    worker = MLXWorker()
    worker.start()
    settings = Settings(base_path=base, models={"model_dirs": [models]}, cache={"enabled": False})
    pool = EnginePool(settings, worker)
    try:
        start = time.perf_counter()
        asyncio.run(pool.get_engine(BUILTIN_MODEL_NAME))
        return time.perf_counter() - start
    finally:
        asyncio.run(pool.close())
        worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = install_default_model(Path(tmp) / "models").parent
        base = Path(tmp) / "base"
        print(f"cold (profile measured, verdict probed): {load_seconds(base, models):.2f} s")
        kept, probed = [], []
        for _ in range(args.repeats):
            kept.append(load_seconds(base, models))
            for verdict in (base / "profiles" / "batching").glob("*.json"):
                verdict.unlink()
            probed.append(load_seconds(base, models))
        print(f"warm, verdict kept:   {statistics.median(kept):.2f} s  {kept}")
        print(f"warm, verdict probed: {statistics.median(probed):.2f} s  {probed}")


if __name__ == "__main__":
    main()
