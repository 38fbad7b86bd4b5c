from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from omlx.engine.pool import EnginePool
from omlx.engine.worker import MLXWorker
from omlx.settings import GenerationSettings, SchedulerSettings


@pytest.fixture
def make_pool(tiny_models_dir: Path) -> Iterator:
    """Build an EnginePool on a running MLX worker; everything is torn down after."""
    made: list[tuple[EnginePool, MLXWorker]] = []

    def make(model_dir: Path = tiny_models_dir, **scheduler: int) -> EnginePool:
        worker = MLXWorker()
        worker.start()
        pool = EnginePool([model_dir], SchedulerSettings(**scheduler), GenerationSettings(), worker)
        made.append((pool, worker))
        return pool

    yield make
    for pool, worker in made:
        asyncio.run(pool.close())
        worker.stop()
