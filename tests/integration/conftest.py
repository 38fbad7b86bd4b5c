from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from omlx.engine.pool import EnginePool
from omlx.engine.worker import MLXWorker
from omlx.settings import Settings


def pool_settings(
    base: Path,
    model_dir: Path,
    cache: dict | None = None,
    memory: dict | None = None,
    **scheduler: float,
):
    """Settings for a test pool: models from ``model_dir``, everything else under ``base``."""
    return Settings(
        base_path=base,
        models={"model_dirs": [model_dir]},
        scheduler=scheduler,
        cache=cache or {"enabled": False},
        memory=memory or {},
    )


@pytest.fixture
def make_pool(tiny_models_dir: Path, tmp_path: Path) -> Iterator:
    """Build an EnginePool on a running MLX worker; everything is torn down after.
    The prefix cache is off unless ``cache`` settings are given; ``clock`` and
    ``busy_wait_s`` go to the pool's constructor."""
    made: list[tuple[EnginePool, MLXWorker]] = []

    def make(
        model_dir: Path = tiny_models_dir,
        cache: dict | None = None,
        memory: dict | None = None,
        clock: Callable[[], float] = time.monotonic,
        busy_wait_s: float = 30.0,
        **scheduler: float,
    ) -> EnginePool:
        worker = MLXWorker()
        worker.start()
        settings = pool_settings(tmp_path, model_dir, cache, memory, **scheduler)
        pool = EnginePool(settings, worker, clock, busy_wait_s=busy_wait_s)
        made.append((pool, worker))
        return pool

    yield make
    for pool, worker in made:
        asyncio.run(pool.close())
        worker.stop()
