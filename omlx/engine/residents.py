"""The loaded models: their engines, the requests leasing them, loading on first
use and unloading by LRU (to make room), TTL (idle) or request.

One load decision (evict + load) runs at a time under the room lock, so two loads
never count the same free room; a release takes the same lock to wait for a load
in progress. The policy (which to evict, which expired) is omlx/engine/residency.py;
building and tearing down an engine on the MLX thread is the builder's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from omlx.embeddings.engine import EmbeddingEngine
from omlx.engine.catalog import ModelCatalog
from omlx.engine.drafts import weights_with_draft
from omlx.engine.model_engine import ModelEngine, unloaded_error
from omlx.engine.pool_memory import PoolMemory
from omlx.engine.release import ReleasedTags
from omlx.engine.residency import ResidentModel, choose_evictions, expired
from omlx.engine.worker import MLXWorker
from omlx.errors import InsufficientMemoryError, ModelLoadError, OmlxError
from omlx.models.discovery import ModelInfo
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)

# A loaded model: an LLM's engine, or an embedding / rerank model's.
Engine = ModelEngine | EmbeddingEngine


class Builder(Protocol):
    """Makes and tears down engines on the MLX thread (omlx/engine/building.py)."""

    def build(self, info: ModelInfo) -> Engine: ...
    def dispose(self, engines: list[Engine]) -> None: ...


@dataclass(slots=True)
class Resident:
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


class Residents:
    """``clock`` is monotonic seconds; ``busy_wait_s``: how long a load waits for
    busy models to go idle before giving up with 507. ``verify``: awaited after a
    load is admitted, before its weights are read; it raises to refuse the model
    (engine/arch_probe.py's child-process probe)."""

    def __init__(
        self,
        catalog: ModelCatalog,
        builder: Builder,
        released: ReleasedTags,
        memory: PoolMemory,
        worker: MLXWorker,
        *,
        clock: Callable[[], float] = time.monotonic,
        busy_wait_s: float = 30.0,
        verify: Callable[[ModelInfo], Awaitable[None]] | None = None,
    ) -> None:
        self._catalog = catalog
        self._builder = builder
        self._released = released
        self._memory = memory
        self._worker = worker
        self.clock = clock
        self.busy_wait_s = busy_wait_s
        self._resident: dict[str, Resident] = {}
        self._loading: set[str] = set()
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._room_lock = asyncio.Lock()
        self._verify = verify
        # Why each model's last load failed (cleared by a load that succeeds).
        self._failures: dict[str, str] = {}
        self.num_loads = 0
        self.num_evictions = 0

    # -- what is loaded ------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._resident)

    def engines(self) -> list[Engine]:
        return [r.engine for r in self._resident.values()]

    def get(self, name: str) -> Resident | None:
        return self._resident.get(name)

    def engine(self, name: str) -> Engine | None:
        resident = self._resident.get(name)
        return resident.engine if resident is not None else None

    def loading_names(self) -> list[str]:
        return sorted(self._loading)

    def failure(self, name: str) -> str | None:
        """Why ``name``'s last load failed, if it did and none succeeded since."""
        return self._failures.get(name)

    def failed_names(self) -> list[str]:
        return sorted(self._failures)

    def find(self, requested: str) -> str | None:
        """The loaded model ``requested`` names (its folder name or alias), if any."""
        if requested in self._resident:
            return requested
        name = self._catalog.model_settings.resolve(requested, self._resident)
        return name if name in self._resident else None

    def busy(self, names: list[str]) -> bool:
        """Whether any of the loaded models ``names`` has a request in flight or leased."""
        return any(r.busy for n, r in self._resident.items() if n in names)

    def used_bytes(self) -> int:
        return sum(r.size_bytes for r in self._resident.values())

    def reweigh(self, name: str) -> None:
        """Count the model's weights again (its draft model changed)."""
        resident = self._resident[name]
        resident.size_bytes = weights_with_draft(resident.engine)

    @asynccontextmanager
    async def room(self) -> AsyncIterator[None]:
        """The room lock: held, no load starts and none is in progress."""
        async with self._room_lock:
            yield

    async def run_on_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._worker.submit(fn, *args))

    @property
    def worker_alive(self) -> bool:
        return self._worker.is_alive

    # -- using and loading ---------------------------------------------------

    async def acquire(self, info: ModelInfo) -> Resident:
        """``info``'s model, loaded first if it is not; marked used now."""
        resident = self._resident.get(info.name) or await self._load(info)
        self.touch(resident)
        return resident

    def touch(self, resident: Resident) -> None:
        resident.last_used_s = self.clock()

    @contextmanager
    def leased(self, resident: Resident) -> Iterator[Engine]:
        """The engine counted busy until the block ends."""
        resident.leases += 1
        try:
            yield resident.engine
        finally:
            resident.leases -= 1

    async def _load(self, info: ModelInfo) -> Resident:
        lock = self._load_locks.setdefault(info.name, asyncio.Lock())
        async with lock:  # one load at a time per model; others wait for it
            resident = self._resident.get(info.name)
            if resident is not None:
                return resident
            async with self._room_lock:
                # A release ran while this load waited: it must not bring memory back.
                self._released.refuse_if_released(info.name)
                await self._make_room(info)
                self._loading.add(info.name)
                try:
                    if self._verify is not None:
                        await self._verify(info)
                    engine = await self.run_on_worker(self._builder.build, info)
                except ModelLoadError as exc:
                    self._failures[info.name] = exc.message
                    raise
                finally:
                    self._loading.discard(info.name)
            self._failures.pop(info.name, None)
            resident = Resident(engine, weights_with_draft(engine), self.clock())
            self._resident[info.name] = resident
            self.num_loads += 1
            self._memory.publish(self.engines())
            return resident

    async def _make_room(self, info: ModelInfo) -> None:
        """Evict LRU idle unpinned models until ``info`` fits the weights budget;
        wait for busy ones for up to ``busy_wait_s``; else 507 with the numbers."""
        need, budget = self._catalog.weights_needed(info), self._memory.model_budget_bytes
        if need > budget:
            raise InsufficientMemoryError(
                f"model '{info.name}' needs about {format_bytes(need)} for its weights but "
                f"the memory budget for models is {format_bytes(budget)}; raise "
                "memory.max_model_memory / memory.max_process_memory or use a smaller "
                "(more quantized) model",
                needed_bytes=need,
                limit_bytes=budget,
                used_bytes=self.used_bytes(),
            )
        deadline = self.clock() + self.busy_wait_s
        while True:
            victims = choose_evictions(self.snapshot(), need, self.used_bytes(), budget)
            if victims is not None:
                for name in victims:
                    log.info("evicting %s (least recently used) to load %s", name, info.name)
                    self.num_evictions += 1
                    why = f"evicted to load {info.name}"
                    await self.unload(name, error=unloaded_error(name, why))
                return
            if self.clock() >= deadline:
                pinned = [n for n in self._resident if self._catalog.pinned(n)]
                raise InsufficientMemoryError(
                    f"model '{info.name}' needs about {format_bytes(need)}; "
                    f"{format_bytes(self.used_bytes())} of the {format_bytes(budget)} "
                    "budget for models is held by models that are pinned "
                    f"({', '.join(pinned) or 'none'}) or busy; unload or unpin one, or raise "
                    "memory.max_model_memory",
                    needed_bytes=need,
                    limit_bytes=budget,
                    used_bytes=self.used_bytes(),
                )
            await asyncio.sleep(0.2)

    # -- LRU, TTL and pins -----------------------------------------------------

    def snapshot(self) -> list[ResidentModel]:
        """What is loaded, as the eviction policy (residency.py) sees it."""
        return [
            ResidentModel(
                name,
                r.size_bytes,
                pinned=self._catalog.pinned(name),
                in_flight=r.busy,
                last_used_s=r.last_used_s,
                ttl_s=self._ttl_s(name, r),
            )
            for name, r in self._resident.items()
        ]

    def _ttl_s(self, name: str, resident: Resident) -> float | None:
        if resident.keep_alive_s is not None:
            return resident.keep_alive_s
        return self._catalog.ttl_s(name)

    def keep_alive(self, requested: str, ttl_s: float | None) -> None:
        """Keep the loaded model ``requested`` for ``ttl_s`` idle seconds from now
        (0: unload once idle; math.inf: until unloaded; None: its configured TTL).
        Pinned models stay loaded whatever is asked."""
        name = self.find(requested)
        if name is None:
            return
        resident = self._resident[name]
        resident.keep_alive_s = ttl_s
        self.touch(resident)

    def idle_expiry_s(self, name: str) -> float | None:
        """Seconds from now until the loaded model ``name`` is unloaded for being idle
        (0 if due); None when it never expires or is not loaded."""
        resident = self._resident.get(name)
        if resident is None or self._catalog.pinned(name):
            return None
        limit = self._ttl_s(name, resident)
        if limit is None:
            limit = self._catalog.settings.models.idle_timeout_s
        if limit is None or limit == math.inf:
            return None
        return max(0.0, resident.last_used_s + limit - self.clock())

    async def expire_idle(self) -> list[str]:
        """Unload models idle past their TTL (or the global idle timeout)."""
        idle_timeout_s = self._catalog.settings.models.idle_timeout_s
        names = expired(self.snapshot(), self.clock(), idle_timeout_s)
        for name in names:
            log.info("unloading %s: idle past its time to live", name)
            await self.unload(name, error=unloaded_error(name, "idle past its time to live"))
        return names

    async def evict_one_idle(self, why: str) -> bool:
        """Unload the least recently used idle unpinned model, if another stays;
        whether one was unloaded."""
        idle = [m for m in self.snapshot() if m.evictable]
        if len(self._resident) <= 1 or not idle:
            return False
        victim = min(idle, key=lambda m: (m.last_used_s, m.name)).name
        log.warning("evicting %s (least recently used) %s", victim, why)
        self.num_evictions += 1
        return await self.unload(victim)

    # -- unloading ------------------------------------------------------------

    async def drain(self, names: list[str], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the models ``names`` to have nothing in
        flight or leased."""
        deadline = self.clock() + timeout_s
        while self.busy(names) and self.clock() < deadline:
            await asyncio.sleep(0.05)

    async def unload(
        self, requested: str, *, drain_s: float = 0.0, error: OmlxError | None = None
    ) -> bool:
        """Unload a model. Requests in flight or leased get ``drain_s`` to finish;
        what is left, and any request that reaches it later, is failed with
        ``error`` (default: a retryable 503). False if it was not loaded."""
        name = self.find(requested)
        if name is None:
            return False
        await self.drain([name], drain_s)
        engine = self._resident[name].engine
        engine.close(error or unloaded_error(name, "on request or to free memory"))
        del engine
        # The list holds the only reference left here: the worker drops it, so
        # the weights are collected there and handed back with this unload.
        engines = [self._resident.pop(name).engine]
        if self._worker.is_alive:
            await self.run_on_worker(self._builder.dispose, engines)
        log.info("unloaded %s", name)
        return True

    async def close(self) -> None:
        """Abort all work and unload every model."""
        engines = self.engines()
        self._resident.clear()
        _close_each(engines, "the server is stopping")
        if self._worker.is_alive:
            await self.run_on_worker(self._builder.dispose, engines)


def _close_each(engines: list[Engine], why: str) -> None:
    """Refuse new requests on each engine. A function, so no loop variable here
    keeps an engine (and its weights) alive past the unload."""
    for engine in engines:
        engine.close(unloaded_error(engine.name, why))
