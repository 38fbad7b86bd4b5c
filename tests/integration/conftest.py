from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from omlx.engine.pool import EnginePool
from omlx.engine.worker import MLXWorker
from omlx.memory.probe import MemoryProbe
from omlx.settings import Settings
from tests.fixtures.servers import share_profiles
from tests.fixtures.tiny_models import build_tiny_model


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
def make_pool(tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path) -> Iterator:
    """Build an EnginePool on a running MLX worker; everything is torn down after.
    The prefix cache is off unless ``cache`` settings are given; ``clock`` and
    ``busy_wait_s`` go to the pool's constructor.

    Models reuse the session's auto-profiles for the same settings, as a restart
    would. ``fresh_profile``: measure at load (tests of the measurement, and tests
    that swap in a probe of their own: its readings must not reach other tests),
    into ``profiles`` when given: a folder that only tests with the same made-up
    readings share."""
    made: list[tuple[EnginePool, MLXWorker, bool]] = []

    def make(
        model_dir: Path = tiny_models_dir,
        cache: dict | None = None,
        memory: dict | None = None,
        clock: Callable[[], float] = time.monotonic,
        busy_wait_s: float = 30.0,
        fresh_profile: bool = False,
        profiles: Path | None = None,
        **scheduler: float,
    ) -> EnginePool:
        assert profiles is None or fresh_profile, "profiles: a folder of fresh_profile's own"
        if not fresh_profile or profiles is not None:
            share_profiles(tmp_path, profiles or profiles_dir)
        worker = MLXWorker()
        worker.start()
        settings = pool_settings(tmp_path, model_dir, cache, memory, **scheduler)
        pool = EnginePool(settings, worker, clock, busy_wait_s=busy_wait_s)
        made.append((pool, worker, not fresh_profile))
        return pool

    yield make
    for pool, worker, _ in made:
        asyncio.run(pool.close())
        worker.stop()
    for pool, _, shared in made:
        own_probe = type(pool.probe) is not MemoryProbe
        assert not (shared and own_probe), "a test's own probe: make_pool(fresh_profile=True)"


@pytest.fixture(scope="session")
def two_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two slow-llama models (different weights): tests of one ceiling shared by two."""
    root = tmp_path_factory.mktemp("two-slow")
    build_tiny_model(root / "slow-a", "slow-llama", seed=2)
    build_tiny_model(root / "slow-b", "slow-llama", seed=3)
    return root
