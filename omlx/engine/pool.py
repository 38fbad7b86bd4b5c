"""EnginePool: the models the server knows, put together from the parts that own
them. The catalog (catalog.py) says which models exist and what each is set to;
the residents (residents.py) hold the loaded engines, their leases, LRU/TTL/pins
and the room lock; the builder (building.py) makes engines on the MLX thread; the
pool's memory (pool_memory.py), the enforcer (enforcer.py), release/resume
(release.py) and the loads at start (startup.py) work through their public
interfaces. Routes call the pool; it hands each call to the part that owns it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from omlx.engine.admission import AdmissionSwitch
from omlx.engine.arch_probe import ArchitectureProbe
from omlx.engine.building import EngineBuilder
from omlx.engine.catalog import DEFAULT_MODEL_NAME, LoadedWeights, ModelCatalog
from omlx.engine.enforcer import Enforcer
from omlx.engine.engine_status import engine_status
from omlx.engine.model_engine import ModelEngine
from omlx.engine.pool_memory import PoolMemory
from omlx.engine.profile_cache import ProfileCache
from omlx.engine.release import ReleasedTags, Releases
from omlx.engine.residents import Engine, Resident, Residents
from omlx.engine.startup import StartupLoads
from omlx.engine.worker import MLXWorker
from omlx.errors import OmlxError
from omlx.memory.budget import Limits
from omlx.memory.probe import MemoryProbe
from omlx.models.discovery import ModelInfo, capabilities, require_kind
from omlx.models.model_settings import RequestDefaults
from omlx.settings import Settings

__all__ = ["DEFAULT_MODEL_NAME", "Engine", "EnginePool"]

log = logging.getLogger(__name__)


class EnginePool:
    """Which models exist, which are loaded; loading on first use, unloading by
    LRU (to make room), TTL (idle) or request. ``clock`` is monotonic seconds;
    ``busy_wait_s``: how long a load waits for busy models before a 507."""

    def __init__(
        self,
        settings: Settings,
        worker: MLXWorker,
        clock: Callable[[], float] = time.monotonic,
        cluster: Any = None,
        *,
        busy_wait_s: float = 30.0,
    ):
        self.settings = settings
        # omlx.distributed.cluster.Cluster: one model split across ranks (None: local).
        self.cluster = cluster
        self.worker = worker
        self.catalog = ModelCatalog(settings, cluster)
        self.model_settings = self.catalog.model_settings
        self.model_dirs = self.catalog.model_dirs
        self.memory = PoolMemory(settings, worker)
        self.model_budget_bytes = self.memory.model_budget_bytes
        self.live_baseline = self.memory.live_baseline
        self.baseline = self.memory.baseline
        self.hot_cache = self.memory.hot_cache
        # Above the soft limit the enforcer pauses admission in every model at once.
        self.admission = AdmissionSwitch()
        # Auto-profiles kept between starts.
        self.profile_cache = ProfileCache(settings.base_path / "profiles")
        self.builder = EngineBuilder(
            settings,
            self.catalog,
            self.memory,
            worker,
            profile_cache=self.profile_cache,
            admission=self.admission,
            cluster=cluster,
        )
        released = ReleasedTags()
        # A new architecture runs in a child first (not when split across ranks).
        self.arch_probe = ArchitectureProbe(settings)
        self.residents = Residents(
            self.catalog, self.builder, released, self.memory, worker,
            clock=clock, busy_wait_s=busy_wait_s,
            verify=None if cluster else self.arch_probe.verify,
        )  # fmt: skip
        self.enforcer = Enforcer(self.residents, self.memory, self.admission)
        # What /release_memory_occupation released; those models wait for resume.
        self.releases = Releases(released, self.residents, self.catalog, self.memory)
        # One GGUF import child at a time, whoever starts it (the admin panel's import
        # route or a download): each may use what the memory ceiling leaves.
        self.import_lock = threading.Lock()
        # The models loaded in the background at start.
        self.startup = StartupLoads(self.catalog, self.residents, self.builder.load_facts)

    # -- the memory in force (swapped by a settings change, and by tests) -----

    @property
    def limits(self) -> Limits:
        return self.memory.limits

    @limits.setter
    def limits(self, limits: Limits) -> None:
        self.memory.limits = limits

    @property
    def probe(self) -> MemoryProbe:
        return self.memory.probe

    @probe.setter
    def probe(self, probe: MemoryProbe) -> None:
        self.memory.probe = probe

    def publish_limits(self) -> None:
        self.memory.publish(self.residents.engines())

    # -- the catalog ------------------------------------------------------------

    def available(self) -> dict[str, ModelInfo]:
        return self.catalog.available()

    def resolve(self, requested: str) -> ModelInfo:
        return self.catalog.resolve(requested)

    def public_name(self, name: str) -> str:
        return self.catalog.public_name(name)

    def default_model(self) -> str | None:
        return self.catalog.default_model()

    def request_defaults(self, name: str) -> RequestDefaults:
        return self.catalog.request_defaults(name)

    def context_window_for(self, loaded: LoadedWeights) -> int:
        return self.catalog.context_window_for(loaded)

    def context_window(self, info: ModelInfo) -> int:
        """The window requests to the model get: the loaded engine's, else its config's."""
        engine = self.engine(info.name)
        window = getattr(engine, "context_window", None) if engine is not None else None
        return window if isinstance(window, int) else self.catalog.context_window_of(info)

    # -- what is loaded ----------------------------------------------------------

    def loaded(self) -> list[Engine]:
        return self.residents.engines()

    def engine(self, name: str) -> Engine | None:
        return self.residents.engine(name)

    def loading_names(self) -> list[str]:
        return self.residents.loading_names()

    def load_facts(self, name: str) -> dict[str, Any]:
        """How the loaded model ``name`` became ready (its profile measured or reused)."""
        return self.builder.load_facts(name)

    @property
    def num_loads(self) -> int:
        return self.residents.num_loads

    @property
    def num_evictions(self) -> int:
        return self.residents.num_evictions

    def model_state(self, name: str) -> str:
        if name in self.residents.loading_names():
            return "loading"
        if self.residents.get(name) is not None:
            return "pinned" if self.catalog.pinned(name) else "loaded"
        return "failed" if self.residents.failure(name) else "unloaded"

    def status(self) -> list[dict[str, Any]]:
        """Every discovered model with its state, for the admin API."""
        now = self.residents.clock()
        return [self._status_of(name, info, now) for name, info in sorted(self.available().items())]

    def _status_of(self, name: str, info: ModelInfo, now: float) -> dict[str, Any]:
        resident = self.residents.get(name)
        model = self.model_settings.get(name)
        return {
            "name": name,
            "alias": model.alias,
            "id": self.public_name(name),
            "path": str(info.path),
            "model_type": info.model_type,
            "kind": model.model_type or info.kind,
            "capabilities": capabilities(model.model_type or info.kind),
            "state": self.model_state(name),
            "error": self.residents.failure(name),
            "pinned": model.pinned,
            "is_default": name == self.default_model(),
            "size_bytes": info.size_bytes,
            "memory_bytes": resident.size_bytes if resident else 0,
            "idle_s": round(now - resident.last_used_s, 1) if resident else None,
            "ttl_s": model.ttl_s,
            **engine_status(resident.engine if resident else None),
        }

    # -- using and loading ---------------------------------------------------------

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
        with self.residents.leased(resident) as engine:
            yield engine

    async def _get_resident(self, requested: str, kind: str | None = None) -> Resident:
        released, residents = self.releases.tags, self.residents
        resident = residents.get(requested)
        if resident is None:
            info = self.resolve(requested)
            require_kind(self.public_name(info.name), info.kind, kind)
            released.refuse_if_released(info.name)
            return await residents.acquire(info)
        require_kind(self.public_name(requested), resident.engine.loaded.info.kind, kind)
        released.refuse_if_released(requested)
        residents.touch(resident)
        return resident

    async def load(self, requested: str) -> Engine:
        """Load a model of any kind (the admin API's load)."""
        engine: Engine = await self.get_engine(requested)
        return engine

    async def settings_changed(self, name: str | None = None) -> None:
        """Apply changed model (or global) settings to loaded engines, without restart.
        Returns once a changed draft model is loaded (or dropped), so the caller's
        next status read shows it."""
        redrafted = []
        for engine in self.loaded():
            if name is None or engine.name == name:
                engine.context_window = self.context_window_for(engine.loaded)
                if isinstance(engine, ModelEngine):
                    engine.num_draft = self.catalog.num_draft_tokens(engine.name)
                    if engine.kv_quant != self.catalog.kv_quant(engine.name):
                        log.info("%s: the new kv_bits applies at its next load", engine.name)
                    if self.builder.draft_changed(engine):
                        redrafted.append(engine)
        swaps = [self.worker.submit(self.builder.redraft, e) for e in redrafted]
        for engine, swap in zip(redrafted, swaps, strict=True):
            await asyncio.wrap_future(swap)
            if self.residents.get(engine.name) is not None:
                self.residents.reweigh(engine.name)  # its draft's weights join the model's

    # -- keep alive, unloading, the enforcer ---------------------------------------

    def keep_alive(self, requested: str, ttl_s: float | None) -> None:
        self.residents.keep_alive(requested, ttl_s)

    def idle_expiry_s(self, name: str) -> float | None:
        return self.residents.idle_expiry_s(name)

    async def unload(
        self, requested: str, *, drain_s: float = 0.0, error: OmlxError | None = None
    ) -> bool:
        """Unload a model; requests in flight or leased get ``drain_s`` to finish
        (omlx/engine/residents.py)."""
        return await self.residents.unload(requested, drain_s=drain_s, error=error)

    async def expire_idle(self) -> list[str]:
        return await self.residents.expire_idle()

    async def evict_one_idle(self, why: str) -> bool:
        return await self.residents.evict_one_idle(why)

    async def enforce(self) -> None:
        """One poll of the enforcer (omlx/engine/enforcer.py)."""
        await self.enforcer.enforce()

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

    # -- release / resume (omlx/engine/release.py) -----------------------------------

    @property
    def released(self) -> set[str]:
        """Every tag released, for all models or some."""
        return self.releases.tags.all_tags()

    async def release(
        self, tags: set[str], model: str | None = None, timeout_s: float = 30.0
    ) -> dict[str, Any]:
        return await self.releases.release(tags, model, timeout_s)

    async def resume(self, tags: set[str], model: str | None = None) -> dict[str, Any]:
        return await self.releases.resume(tags, model)

    async def close(self) -> None:
        """Abort all work and unload every model."""
        await self.residents.close()
