"""EnginePool: which models exist, which are loaded, and loading on first use."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from omlx.engine.model_engine import ModelEngine
from omlx.engine.runner import BatchRunner
from omlx.engine.worker import MLXWorker
from omlx.errors import ModelNotFoundError
from omlx.memory.budget import guard_dims
from omlx.memory.guard import MemoryGuard, memory_limits
from omlx.memory.probe import MemoryProbe, total_ram_bytes
from omlx.models.discovery import ModelInfo, discover_models
from omlx.models.loader import LoadedModel, load_model
from omlx.scheduler import Scheduler
from omlx.settings import GenerationSettings, MemorySettings, SchedulerSettings
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)


class EnginePool:
    def __init__(
        self,
        model_dirs: list[Path],
        scheduler: SchedulerSettings,
        generation: GenerationSettings,
        worker: MLXWorker,
        memory: MemorySettings | None = None,
    ):
        self.model_dirs = model_dirs
        self._scheduler_settings = scheduler
        self._generation = generation
        self._worker = worker
        memory = memory or MemorySettings()
        ram = total_ram_bytes()
        self.limits = memory_limits(memory, ram)
        self.probe = MemoryProbe(memory.poll_interval_s)
        log.info(
            "memguard: hard limit %s (max_process_memory=%s, RAM %s), soft %s, transient margin %s",
            format_bytes(self.limits.hard_bytes),
            memory.max_process_memory,
            format_bytes(ram),
            format_bytes(self.limits.soft_bytes),
            format_bytes(self.limits.transient_margin_bytes),
        )
        self._engines: dict[str, ModelEngine] = {}
        self._load_locks: dict[str, asyncio.Lock] = {}

    def available(self) -> dict[str, ModelInfo]:
        """Re-scan the model dirs (cheap: a few stat calls per folder)."""
        return discover_models(self.model_dirs)

    def loaded(self) -> list[ModelEngine]:
        return list(self._engines.values())

    def resolve(self, name: str) -> ModelInfo:
        models = self.available()
        info = models.get(name)
        if info is None:
            raise ModelNotFoundError(name, sorted(models))
        return info

    async def get_engine(self, name: str) -> ModelEngine:
        """The engine for ``name``, loading it first if needed (one load at a time)."""
        engine = self._engines.get(name)
        if engine is not None:
            return engine
        info = self.resolve(name)
        lock = self._load_locks.setdefault(info.name, asyncio.Lock())
        async with lock:
            engine = self._engines.get(info.name)
            if engine is None:
                future = self._worker.submit(self._load_on_worker, info)
                engine = await asyncio.wrap_future(future)
                self._engines[info.name] = engine
        return engine

    def _load_on_worker(self, info: ModelInfo) -> ModelEngine:
        loaded = load_model(info)
        engine = self._make_engine(loaded)
        self._worker.attach(engine)
        return engine

    def _make_engine(self, loaded: LoadedModel) -> ModelEngine:
        sched = self._scheduler_settings
        runner = BatchRunner(
            loaded.model,
            max_batch_size=sched.max_concurrent_requests,
            prefill_step_size=sched.prefill_step_size,
            stream=self._worker.stream,
        )
        scheduler = Scheduler(sched.max_concurrent_requests, sched.max_queued_requests)
        window = self._generation.max_context_window
        if loaded.native_context:
            window = min(window, loaded.native_context)
        dims = guard_dims(
            loaded.config, kv_dtype_bytes=_activation_bytes(loaded.model), model=loaded.info.name
        )
        guard = MemoryGuard(
            loaded.info.name,
            dims,
            limits=self.limits,
            baseline_bytes=self.probe.reading(fresh=True).resident_bytes,
            chunk_tokens=sched.prefill_step_size,
        )
        log.info(guard.describe())
        return ModelEngine(
            loaded, runner, scheduler, self._worker, context_window=window, guard=guard
        )

    async def close(self) -> None:
        """Abort all work and unload every model."""
        engines, self._engines = list(self._engines.values()), {}
        if not self._worker.is_alive:
            return
        for engine in engines:
            await asyncio.wrap_future(self._worker.submit(self._unload_on_worker, engine))

    def _unload_on_worker(self, engine: ModelEngine) -> None:
        self._worker.detach(engine)
        engine.shutdown()


def _activation_bytes(model: object) -> int:
    """Bytes per element of the model's floating parameters (the KV cache dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, param in tree_flatten(model.parameters()):  # type: ignore[attr-defined]
        if mx.issubdtype(param.dtype, mx.floating):
            return int(param.dtype.size)
    return 2
