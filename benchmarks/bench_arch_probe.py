"""What the child-process architecture probe (engine/arch_probe.py) adds to a load.

A model is loaded into a fresh base path through a real EnginePool, with
``models.probe_new_architectures`` off and on (a fresh base: no verdict kept, so the
probe runs), alternately; the difference of the medians is the probe's cost. The
auto-profile runs in both (fresh base), so "load" here is a cold first load; its
spread can hide the probe, so the child alone is timed too.

    .venv/bin/python benchmarks/bench_arch_probe.py --repeats 3
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

from omlx.engine.arch_probe import run_child
from omlx.engine.pool import EnginePool
from omlx.engine.worker import MLXWorker
from omlx.models.builtin import install_default_model
from omlx.models.discovery import discover_models
from omlx.settings import Settings
from tests.fixtures.breadth_models import build_breadth_model


async def _load(models: Path, name: str, probe: bool) -> float:
    with tempfile.TemporaryDirectory() as base:
        settings = Settings(
            base_path=Path(base),
            models={"model_dirs": [models], "probe_new_architectures": probe},
            cache={"enabled": False},
        )
        worker = MLXWorker()
        worker.start()
        pool = EnginePool(settings, worker)
        try:
            started = time.perf_counter()
            await pool.load(name)
            return time.perf_counter() - started
        finally:
            await pool.close()
            worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        smol = install_default_model(Path(root) / "builtin")
        tiny = Path(root) / "tiny"
        build_breadth_model(tiny / "tiny-llama", "llama")
        for models, name in ((smol.parent, smol.name), (tiny, "tiny-llama")):
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for probe in (False, True):
                    runs[probe].append(asyncio.run(_load(models, name, probe)))
            off, on = statistics.median(runs[False]), statistics.median(runs[True])
            info = discover_models([models])[name]
            child = [asyncio.run(run_child(info, 512)).seconds for _ in range(args.repeats)]
            print(
                f"{name}: cold load {off:.2f} s, with the probe {on:.2f} s "
                f"(+{on - off:.2f} s); the probe child alone {statistics.median(child):.2f} s"
            )


if __name__ == "__main__":
    main()
