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


@pytest.fixture(scope="session")
def mlx_probe_profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Auto-profiles measured under ``MLXProbe`` (MLX's own accounting, no process
    footprint), shared by the tests that load their models with it: each model is
    measured once per settings under that probe, never mixed with the real probe's."""
    return tmp_path_factory.mktemp("mlx-probe-profiles")


@pytest.fixture
def make_pool(tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path) -> Iterator:
    """Build an EnginePool on a running MLX worker; everything is torn down after.
    The prefix cache is off unless ``cache`` settings are given; ``clock`` and
    ``busy_wait_s`` go to the pool's constructor.

    Models reuse the session's auto-profiles for the same settings, as a restart
    would. ``fresh_profile``: measure at load (tests of the measurement, and tests
    that swap in a probe of their own: its readings must not reach other tests).
    ``profiles``: a folder of profiles measured under the test's own probe instead
    (``mlx_probe_profiles``, or a module's own for made-up readings), shared only by
    tests that load with the same probe."""
    # (pool, worker, whose profiles it reuses: "session", "own" or None, measured fresh)
    made: list[tuple[EnginePool, MLXWorker, str | None]] = []

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
        assert not (fresh_profile and profiles), "measure fresh, or reuse ``profiles``"
        if not fresh_profile:
            share_profiles(tmp_path, profiles or profiles_dir)
        worker = MLXWorker()
        worker.start()
        settings = pool_settings(tmp_path, model_dir, cache, memory, **scheduler)
        pool = EnginePool(settings, worker, clock, busy_wait_s=busy_wait_s)
        reuses = None if fresh_profile else "own" if profiles else "session"
        made.append((pool, worker, reuses))
        return pool

    yield make
    for pool, worker, _ in made:
        asyncio.run(pool.close())
        worker.stop()
    for pool, _, reuses in made:
        own_probe = type(pool.probe) is not MemoryProbe
        assert not (reuses == "session" and own_probe), (
            "a test's own probe: make_pool(fresh_profile=True) or profiles=mlx_probe_profiles"
        )
        assert not (reuses == "own" and not own_probe), "the real probe: the session's profiles"


@pytest.fixture(scope="session")
def two_models_dir(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two slow-llama models (different weights): tests of one ceiling shared by two.
    slow-a is ``tiny_models_dir``'s slow-llama (the same seed), linked: its auto-profile
    and batching verdict are kept by the folder's real path, so one measured under the
    same probe and settings is reused, as at a restart, instead of measured again."""
    root = tmp_path_factory.mktemp("two-slow")
    (root / "slow-a").symlink_to(tiny_models_dir / "slow-llama", target_is_directory=True)
    build_tiny_model(root / "slow-b", "slow-llama", seed=3)
    return root
