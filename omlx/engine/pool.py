"""EnginePool: which models exist, which are loaded, and loading on first use."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from pathlib import Path
from typing import Literal

from omlx.cache.hot import HotTier
from omlx.cache.kv_codec import layer_layout
from omlx.cache.prefix import PrefixCache, model_identity
from omlx.cache.ssd import SSDStore
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
from omlx.settings import Settings
from omlx.sizes import format_bytes, parse_byte_size

log = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, settings: Settings, worker: MLXWorker):
        self.settings = settings
        self.model_dirs = settings.model_dirs
        self._worker = worker
        memory = settings.memory
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
        self.hot_cache = _make_hot_tier(settings, ram)

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
        sched = self.settings.scheduler
        prefix = self._make_prefix_cache(loaded)
        runner = BatchRunner(
            loaded.model,
            max_batch_size=sched.max_concurrent_requests,
            prefill_step_size=sched.prefill_step_size,
            stream=self._worker.stream,
            prefix_cache=prefix,
        )
        scheduler = Scheduler(sched.max_concurrent_requests, sched.max_queued_requests)
        window = self.settings.generation.max_context_window
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
            loaded,
            runner,
            scheduler,
            self._worker,
            context_window=window,
            guard=guard,
            prefix_cache=prefix,
        )

    def _make_prefix_cache(self, loaded: LoadedModel) -> PrefixCache | None:
        """MLX thread. None when the cache is off or the model's layers cannot be cached."""
        from mlx_lm.models.cache import make_prompt_cache

        cfg = self.settings.cache
        if self.hot_cache is None:
            return None
        name = loaded.info.name
        layout = layer_layout(make_prompt_cache(loaded.model))
        if layout is None:
            kinds = sorted({type(c).__name__ for c in make_prompt_cache(loaded.model)})
            log.warning("prefix cache off for %s: cache types %s are not supported", name, kinds)
            return None
        identity = model_identity(name, loaded.info.path)
        ssd = None
        if cfg.hot_cache_mode != "hot-only":
            directory = self.settings.cache_dir / _safe_dir_name(name)
            ssd = SSDStore(
                directory,
                model_identity=identity,
                layer_layout=layout,
                block_size=cfg.block_size,
                max_size_bytes=_ssd_budget(cfg.ssd_cache_max_size, directory),
                auto_fraction=cfg.ssd_auto_fraction,
            )
        prefix = PrefixCache(identity, layout, cfg.block_size, self.hot_cache, ssd)
        log.info(
            "prefix cache for %s: %s, block %d tokens, %s%s",
            name,
            identity,
            cfg.block_size,
            "sliceable KV" if prefix.sliceable else "boundary snapshots (recurrent layers)",
            f", SSD {ssd.cache_dir} ({len(ssd.keys())} blocks)" if ssd else ", RAM only",
        )
        return prefix

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
        if engine.prefix_cache is not None:
            engine.prefix_cache.close()


def _activation_bytes(model: object) -> int:
    """Bytes per element of the model's floating parameters (the KV cache dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, param in tree_flatten(model.parameters()):  # type: ignore[attr-defined]
        if mx.issubdtype(param.dtype, mx.floating):
            return int(param.dtype.size)
    return 2


def _make_hot_tier(settings: Settings, ram_bytes: int) -> HotTier | None:
    cfg = settings.cache
    if not cfg.enabled:
        log.info("prefix cache disabled (cache.enabled=false)")
        return None
    budget = parse_byte_size(
        cfg.hot_cache_max_size, total_bytes=ram_bytes, field="cache.hot_cache_max_size"
    )
    log.info(
        "prefix cache: RAM tier %s (%s), SSD tier %s",
        format_bytes(budget),
        cfg.hot_cache_mode,
        "off" if cfg.hot_cache_mode == "hot-only" else settings.cache_dir,
    )
    return HotTier(budget, mode=cfg.hot_cache_mode)


def _ssd_budget(value: str | int, directory: Path) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    directory.mkdir(parents=True, exist_ok=True)
    total = shutil.disk_usage(directory).total
    return parse_byte_size(value, total_bytes=total, field="cache.ssd_cache_max_size")


def _safe_dir_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
