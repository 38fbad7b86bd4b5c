"""EnginePool: which models exist, which are loaded, and loading on first use."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from omlx.cache.setup import make_hot_tier
from omlx.embeddings.engine import EmbeddingEngine, make_embedding_engine
from omlx.engine.assembly import EngineParts, build_engine
from omlx.engine.drafts import attach_draft, configured_draft, weights_with_draft
from omlx.engine.enforcer import Enforcer
from omlx.engine.engine_status import engine_status
from omlx.engine.live_baseline import LiveBaseline
from omlx.engine.model_engine import ModelEngine, unloaded_error
from omlx.engine.profile_cache import ProfileCache
from omlx.engine.release import Releases
from omlx.engine.residency import ResidentModel, choose_evictions, expired
from omlx.engine.startup import StartupLoads
from omlx.engine.worker import MLXWorker
from omlx.errors import (
    InsufficientMemoryError,
    ModelNotFoundError,
    OmlxError,
)
from omlx.memory import mlx_stats
from omlx.memory.budget import Limits
from omlx.memory.guard import memory_limits
from omlx.memory.probe import MemoryProbe, total_ram_bytes
from omlx.models.discovery import (
    ModelInfo,
    capabilities,
    discover_models,
    require_kind,
    with_kind,
)
from omlx.models.loader import LoadedModel, load_model
from omlx.models.model_settings import (
    ModelSettingsStore,
    RequestDefaults,
    effective_context_window,
    request_defaults,
)
from omlx.settings import Settings
from omlx.sizes import format_bytes, parse_byte_size

log = logging.getLogger(__name__)

# A loaded model: an LLM's engine, or an embedding / rerank model's.
Engine = ModelEngine | EmbeddingEngine

# A request for this model name gets the default model (per-model is_default,
# else models.default_model), unless a model is really called that.
DEFAULT_MODEL_NAME = "default"


@dataclass(slots=True)
class _Resident:
    engine: Engine
    size_bytes: int
    last_used_s: float
    # Requests holding the engine between fetch and submit (template render,
    # grammar compile): busy like the ones in flight, so nothing unloads it unseen.
    leases: int = 0
    # Idle seconds a client asked for (Ollama's keep_alive), over the configured TTL;
    # it goes with the engine, so a reload starts from the settings again.
    keep_alive_s: float | None = None

    @property
    def busy(self) -> int:
        return self.engine.num_in_flight + self.leases


class EnginePool:
    """Which models exist, which are loaded; loading on first use, unloading by
    LRU (to make room), TTL (idle) or request. ``clock`` is monotonic seconds."""

    # How long a load waits for busy models to go idle before giving up with 507.
    busy_wait_s = 30.0

    def __init__(
        self,
        settings: Settings,
        worker: MLXWorker,
        clock: Callable[[], float] = time.monotonic,
        cluster: Any = None,
    ):
        self.settings = settings
        # omlx.distributed.cluster.Cluster: one model split across ranks (None: local).
        self.cluster = cluster
        self.model_dirs = settings.model_dirs
        self._worker = worker
        self._clock = clock
        memory = settings.memory
        ram = total_ram_bytes()
        self.limits = memory_limits(memory, ram)
        self.model_budget_bytes = _model_budget(memory.max_model_memory, self.limits.hard_bytes)
        # MLX's counters are sampled on the MLX thread after every turn and
        # published; readings on other threads (HTTP, enforcer) use that sample.
        self.probe = MemoryProbe(memory.poll_interval_s, on_mlx_thread=worker.on_thread)
        # What the process holds with nothing in flight, for every model's guard.
        self.live_baseline = LiveBaseline(lambda: self.probe, worker)
        self.baseline = self.live_baseline.baseline
        self._mlx_limits: Limits | None = None
        self._apply_mlx_limits()
        log.info(
            "memguard: hard limit %s (max_process_memory=%s, RAM %s), soft %s, transient margin "
            "%s, weights budget %s",
            format_bytes(self.limits.hard_bytes),
            memory.max_process_memory,
            format_bytes(ram),
            format_bytes(self.limits.soft_bytes),
            format_bytes(self.limits.transient_margin_bytes)
            if self.limits.margin_pinned
            else "auto (each model's measured step transient x1.25, at least 64 MiB)",
            format_bytes(self.model_budget_bytes),
        )
        self.model_settings = ModelSettingsStore(settings.model_settings_path)
        self._resident: dict[str, _Resident] = {}
        self._loading: set[str] = set()
        self._load_locks: dict[str, asyncio.Lock] = {}
        # One load decision (evict + load) at a time, so two loads never count
        # the same free room.
        self._room_lock = asyncio.Lock()
        self.hot_cache = make_hot_tier(settings, ram)
        self.num_loads = 0
        self.num_evictions = 0
        self.enforcer = Enforcer(self)
        # What /release_memory_occupation released; those models wait for resume.
        self.releases = Releases(self)
        # One GGUF import child at a time, whoever starts it (the admin panel's import
        # route or a download): each may use what the memory ceiling leaves.
        self.import_lock = threading.Lock()
        # Auto-profiles kept between starts; the models loaded in the background at start.
        self.profile_cache = ProfileCache(settings.base_path / "profiles")
        self.startup = StartupLoads(self)
        # Per loaded model: whether its profile was measured or reused (for /health).
        self._load_facts: dict[str, dict[str, Any]] = {}

    # -- discovery and names ------------------------------------------------

    def available(self) -> dict[str, ModelInfo]:
        """Re-scan the model dirs (cheap: a few stat calls per folder)."""
        models = discover_models(self.model_dirs)
        if self.cluster is not None:  # one model split across ranks, and nothing else
            models = {n: i for n, i in models.items() if n == self.cluster.model}
        return models

    def loaded(self) -> list[Engine]:
        return [r.engine for r in self._resident.values()]

    def engine(self, name: str) -> Engine | None:
        resident = self._resident.get(name)
        return resident.engine if resident is not None else None

    def resolve(self, requested: str) -> ModelInfo:
        """A folder name or alias -> the model; ModelNotFoundError lists what exists."""
        models = self.available()
        name = self.model_settings.resolve(requested, models)
        if name is None and requested == DEFAULT_MODEL_NAME:
            name = self.default_model()
        info = models.get(name) if name is not None else None
        if info is None:
            shown = sorted(self.public_name(n) for n in models)
            raise ModelNotFoundError(requested, shown)
        return with_kind(info, self.model_settings.get(info.name).model_type)

    def public_name(self, name: str) -> str:
        """What clients see for a model folder: its alias, else its name."""
        return self.model_settings.alias_of(name)

    def default_model(self) -> str | None:
        return self.model_settings.default_model() or self.settings.models.default_model

    def loading_names(self) -> list[str]:
        return sorted(self._loading)

    def load_facts(self, name: str) -> dict[str, Any]:
        """How the loaded model ``name`` became ready (its profile measured or reused)."""
        return dict(self._load_facts.get(name, {}))

    def model_state(self, name: str) -> str:
        if name in self._loading:
            return "loading"
        if name in self._resident:
            return "pinned" if self.model_settings.get(name).pinned else "loaded"
        return "unloaded"

    def status(self) -> list[dict[str, Any]]:
        """Every discovered model with its state, for the admin API."""
        now = self._clock()
        out = []
        for name, info in sorted(self.available().items()):
            resident = self._resident.get(name)
            model = self.model_settings.get(name)
            out.append(
                {
                    "name": name,
                    "alias": model.alias,
                    "id": self.public_name(name),
                    "path": str(info.path),
                    "model_type": info.model_type,
                    "kind": model.model_type or info.kind,
                    "capabilities": capabilities(model.model_type or info.kind),
                    "state": self.model_state(name),
                    "pinned": model.pinned,
                    "is_default": name == self.default_model(),
                    "size_bytes": info.size_bytes,
                    "memory_bytes": resident.size_bytes if resident else 0,
                    "idle_s": round(now - resident.last_used_s, 1) if resident else None,
                    "ttl_s": model.ttl_s,
                    **engine_status(resident.engine if resident else None),
                }
            )
        return out

    # -- loading ------------------------------------------------------------

    async def get_engine(self, requested: str, kind: str | None = None) -> Any:
        """The engine for ``requested`` (name or alias), loading it first if needed;
        with ``kind``, a model of another kind is a 400 before anything loads."""
        return (await self._get_resident(requested, kind)).engine

    @asynccontextmanager
    async def lease(self, requested: str, kind: str = "chat") -> AsyncIterator[Any]:
        """The engine for ``requested``, counted busy until the block ends: a request
        awaiting its template or grammar before ``submit`` is drained by unload and
        release like one in flight, and never evicted."""
        resident = await self._get_resident(requested, kind)
        resident.leases += 1
        try:
            yield resident.engine
        finally:
            resident.leases -= 1

    async def _get_resident(self, requested: str, kind: str | None = None) -> _Resident:
        resident = self._resident.get(requested)
        if resident is None:
            info = self.resolve(requested)
            require_kind(self.public_name(info.name), info.kind, kind)
            self.releases.refuse_if_released(info.name)
            resident = self._resident.get(info.name) or await self._load(info)
        else:
            require_kind(self.public_name(requested), resident.engine.loaded.info.kind, kind)
            self.releases.refuse_if_released(requested)
        resident.last_used_s = self._clock()
        return resident

    async def load(self, requested: str) -> Engine:
        """Load a model of any kind (the admin API's load)."""
        engine: Engine = await self.get_engine(requested)
        return engine

    async def _load(self, info: ModelInfo) -> _Resident:
        lock = self._load_locks.setdefault(info.name, asyncio.Lock())
        async with lock:  # one load at a time per model; others wait for it
            resident = self._resident.get(info.name)
            if resident is not None:
                return resident
            async with self._room_lock:
                # A release ran while this load waited: it must not bring memory back.
                self.releases.refuse_if_released(info.name)
                await self._make_room(info)
                self._loading.add(info.name)
                try:
                    future = self._worker.submit(self._load_on_worker, info)
                    engine = await asyncio.wrap_future(future)
                finally:
                    self._loading.discard(info.name)
            resident = _Resident(engine, weights_with_draft(engine), self._clock())
            self._resident[info.name] = resident
            self.num_loads += 1
            self.publish_limits()
            return resident

    async def _make_room(self, info: ModelInfo) -> None:
        """Evict LRU idle unpinned models until ``info`` fits the weights budget;
        wait for busy ones for up to ``busy_wait_s``; else 507 with the numbers."""
        draft = self._draft_info(info.name)
        need = info.size_bytes + (draft.size_bytes if draft is not None else 0)
        budget = self.model_budget_bytes
        if need > budget:
            raise InsufficientMemoryError(
                f"model '{info.name}' needs about {format_bytes(need)} for its weights but "
                f"the memory budget for models is {format_bytes(budget)}; raise "
                "memory.max_model_memory / memory.max_process_memory or use a smaller "
                "(more quantized) model",
                needed_bytes=need,
                limit_bytes=budget,
                used_bytes=self._used_bytes(),
            )
        deadline = self._clock() + self.busy_wait_s
        while True:
            victims = choose_evictions(self._residents(), need, self._used_bytes(), budget)
            if victims is not None:
                for name in victims:
                    log.info("evicting %s (least recently used) to load %s", name, info.name)
                    self.num_evictions += 1
                    why = f"evicted to load {info.name}"
                    await self.unload(name, error=unloaded_error(name, why))
                return
            if self._clock() >= deadline:
                pinned = [n for n, r in self._resident.items() if self._pinned(n)]
                raise InsufficientMemoryError(
                    f"model '{info.name}' needs about {format_bytes(need)}; "
                    f"{format_bytes(self._used_bytes())} of the {format_bytes(budget)} "
                    "budget for models is held by models that are pinned "
                    f"({', '.join(pinned) or 'none'}) or busy; unload or unpin one, or raise "
                    "memory.max_model_memory",
                    needed_bytes=need,
                    limit_bytes=budget,
                    used_bytes=self._used_bytes(),
                )
            await asyncio.sleep(0.2)

    def _pinned(self, name: str) -> bool:
        return self.model_settings.get(name).pinned

    def _used_bytes(self) -> int:
        return sum(r.size_bytes for r in self._resident.values())

    def _residents(self) -> list[ResidentModel]:
        return [
            ResidentModel(
                name,
                r.size_bytes,
                pinned=self._pinned(name),
                in_flight=r.busy,
                last_used_s=r.last_used_s,
                ttl_s=self._ttl_s(name, r),
            )
            for name, r in self._resident.items()
        ]

    def _ttl_s(self, name: str, resident: _Resident) -> float | None:
        if resident.keep_alive_s is not None:
            return resident.keep_alive_s
        return self.model_settings.get(name).ttl_s

    # -- keep alive (Ollama's keep_alive) -------------------------------------

    def keep_alive(self, requested: str, ttl_s: float | None) -> None:
        """Keep the loaded model ``requested`` for ``ttl_s`` idle seconds from now
        (0: unload once idle; math.inf: until unloaded; None: its configured TTL).
        Pinned models stay loaded whatever is asked."""
        name = self._resident_name(requested)
        if name is None:
            return
        resident = self._resident[name]
        resident.keep_alive_s = ttl_s
        resident.last_used_s = self._clock()

    def idle_expiry_s(self, name: str) -> float | None:
        """Seconds from now until the loaded model ``name`` is unloaded for being idle
        (0 if due); None when it never expires or is not loaded."""
        resident = self._resident.get(name)
        if resident is None or self._pinned(name):
            return None
        limit = self._ttl_s(name, resident)
        if limit is None:
            limit = self.settings.models.idle_timeout_s
        if limit is None or limit == math.inf:
            return None
        return max(0.0, resident.last_used_s + limit - self._clock())

    # -- unloading ----------------------------------------------------------

    async def unload(
        self, requested: str, *, drain_s: float = 0.0, error: OmlxError | None = None
    ) -> bool:
        """Unload a model. Requests in flight or leased get ``drain_s`` to finish;
        what is left, and any request that reaches it later, is failed with
        ``error`` (default: a retryable 503). False if it was not loaded."""
        name = self._resident_name(requested)
        if name is None:
            return False
        resident = self._resident[name]
        deadline = self._clock() + drain_s
        while resident.busy and self._clock() < deadline:
            await asyncio.sleep(0.05)
        resident.engine.close(error or unloaded_error(name, "on request or to free memory"))
        # The list holds the only reference left here: the worker drops it, so
        # the weights are collected there and handed back with this unload.
        engines = [self._resident.pop(name).engine]
        del resident
        if self._worker.is_alive:
            await asyncio.wrap_future(self._worker.submit(self._unload_on_worker, engines))
        log.info("unloaded %s", name)
        return True

    def _resident_name(self, requested: str) -> str | None:
        if requested in self._resident:
            return requested
        name = self.model_settings.resolve(requested, self._resident)
        return name if name in self._resident else None

    async def expire_idle(self) -> list[str]:
        """Unload models idle past their TTL (or the global idle timeout)."""
        names = expired(self._residents(), self._clock(), self.settings.models.idle_timeout_s)
        for name in names:
            log.info("unloading %s: idle past its time to live", name)
            await self.unload(name, error=unloaded_error(name, "idle past its time to live"))
        return names

    async def maintain(self, interval_s: float) -> None:
        """Background task (the enforcer): every poll, limits published to every
        engine, memory enforced, idle models expired."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.enforce()
                await self.expire_idle()
            except Exception:
                log.exception("pool maintenance failed")

    async def enforce(self) -> None:
        """One poll of the enforcer (omlx/engine/enforcer.py)."""
        await self.enforcer.enforce()

    async def evict_one_idle(self, why: str) -> None:
        """Unload the least recently used idle unpinned model, if another stays."""
        idle = [m for m in self._residents() if m.evictable]
        if len(self._resident) > 1 and idle:
            victim = min(idle, key=lambda m: (m.last_used_s, m.name)).name
            log.warning("evicting %s (least recently used) %s", victim, why)
            self.num_evictions += 1
            await self.unload(victim)

    @property
    def worker(self) -> MLXWorker:
        return self._worker

    # -- release / resume (omlx/engine/release.py) ---------------------------

    @property
    def released(self) -> set[str]:
        """Every tag released, for all models or some."""
        return self.releases.all_tags()

    async def release(
        self, tags: set[str], model: str | None = None, timeout_s: float = 30.0
    ) -> dict[str, Any]:
        return await self.releases.release(tags, model, timeout_s)

    async def resume(self, tags: set[str], model: str | None = None) -> dict[str, Any]:
        return await self.releases.resume(tags, model)

    def request_defaults(self, name: str) -> RequestDefaults:
        """Global sampling/generation defaults with the model's settings over them."""
        return request_defaults(self.settings, self.model_settings.get(name))

    def context_window_for(self, loaded: LoadedModel) -> int:
        return effective_context_window(
            self.model_settings.get(loaded.info.name).max_context_window,
            self.settings.generation.max_context_window,
            loaded.native_context,
        )

    async def settings_changed(self, name: str | None = None) -> None:
        """Apply changed model (or global) settings to loaded engines, without restart.
        Returns once a changed draft model is loaded (or dropped), so the caller's
        next status read shows it."""
        swaps = []
        for resident in self._resident.values():
            engine = resident.engine
            if name is None or engine.name == name:
                engine.context_window = self.context_window_for(engine.loaded)
                if isinstance(engine, ModelEngine):
                    engine.num_draft = self.model_settings.get(engine.name).num_draft_tokens
                    if self._draft_changed(engine):
                        swaps.append(self._worker.submit(self._redraft_on_worker, resident))
        for swap in swaps:
            await asyncio.wrap_future(swap)

    def _draft_info(self, name: str) -> ModelInfo | None:
        """The draft model ``name``'s settings give it (None: none, or distributed)."""
        if self.cluster is not None:
            return None
        return configured_draft(self.model_settings.get(name).draft_model, name, self.available)

    def _redraft_on_worker(self, resident: _Resident) -> None:
        """Load (or drop) a loaded model's draft model when its settings name another;
        its weights join the model's. Read here, in submission order, so the last
        settings change wins when several race."""
        engine = resident.engine
        assert isinstance(engine, ModelEngine)
        if not self._draft_changed(engine):
            return
        with self.live_baseline.tracking():
            engine.draft = attach_draft(engine, self._draft_info(engine.name))
        resident.size_bytes = weights_with_draft(engine)

    def _draft_changed(self, engine: ModelEngine) -> bool:
        """Whether ``engine``'s settings name another draft model than it drafts with."""
        draft = self._draft_info(engine.name)
        return (draft and draft.name) != (engine.draft and engine.draft.name)

    def publish_limits(self) -> None:
        for resident in self._resident.values():
            resident.engine.guard.publish(self.limits)
        self._apply_mlx_limits()

    def _apply_mlx_limits(self) -> None:
        """MLX's own memory/cache limits follow the hard limit (set on the MLX thread)."""
        if self._mlx_limits is not self.limits:
            self._mlx_limits = self.limits
            self._worker.post(mlx_stats.apply_limits, self.limits)

    def _load_on_worker(self, info: ModelInfo) -> Engine:
        engine: Engine
        with self.live_baseline.tracking():
            if info.kind in ("embedding", "rerank"):
                sched = self.settings.scheduler
                capacity = sched.max_concurrent_requests + sched.max_queued_requests
                engine = make_embedding_engine(
                    info, self._worker, self.limits, self.probe, capacity
                )
            else:
                cluster = self.cluster
                engine = self._make_engine(cluster.load(info) if cluster else load_model(info))
            self._worker.attach(engine)
        log.info(engine.guard.describe())
        return engine

    def _make_engine(self, loaded: LoadedModel) -> ModelEngine:
        # Built at each load: the limits object is swapped when the settings change.
        parts = EngineParts(
            self.settings,
            self._worker,
            self.hot_cache,
            self.limits,
            self.probe,
            self.profile_cache,
            self.live_baseline.bytes_now,
            self.cluster,
        )
        name = loaded.info.name
        explicit = self.model_settings.get(name).max_kv_tokens or self.settings.memory.max_kv_tokens
        engine, facts = build_engine(
            loaded, parts, window=self.context_window_for(loaded), explicit_kv_tokens=explicit
        )
        self._load_facts[name] = facts
        engine.num_draft = self.model_settings.get(name).num_draft_tokens
        draft = self._draft_info(name)
        if draft is not None:
            engine.draft = attach_draft(engine, draft)
        return engine

    async def close(self) -> None:
        """Abort all work and unload every model."""
        engines = [r.engine for r in self._resident.values()]
        self._resident.clear()
        _close_each(engines, "the server is stopping")
        if self._worker.is_alive:
            await asyncio.wrap_future(self._worker.submit(self._unload_on_worker, engines))

    def _unload_on_worker(self, engines: list[Engine]) -> None:
        """Stop stepping and drop the engines (the list is emptied: the caller keeps
        no reference), then hand their memory back and track the baseline."""
        with self.live_baseline.tracking():
            while engines:
                engine = engines.pop()
                self._worker.detach(engine)
                engine.shutdown()
                if engine.prefix_cache is not None:
                    engine.prefix_cache.close()
                del engine
            # Engines, runners and their batches reference each other: collect the
            # cycles now so the weights go back to the system with this unload.
            gc.collect()
            mlx_stats.release_cache()


def _close_each(engines: list[Engine], why: str) -> None:
    """Refuse new requests on each engine. A function, so no loop variable here
    keeps an engine (and its weights) alive past the unload."""
    for engine in engines:
        engine.close(unloaded_error(engine.name, why))


def _model_budget(value: str | int, hard_bytes: int) -> int:
    if value == "auto":
        return hard_bytes
    return min(hard_bytes, parse_byte_size(value, total_bytes=hard_bytes, field="max_model_memory"))
