"""Release and resume memory occupation ("weights", "kv_cache") for every model or
one. What is released refuses requests until it is resumed; models whose weights a
release unloaded are loaded back once nothing released blocks them any more."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from omlx.errors import InvalidRequestError, MemoryPressureError
from omlx.memory import mlx_stats
from omlx.sizes import format_bytes

if TYPE_CHECKING:
    from omlx.engine.catalog import ModelCatalog
    from omlx.engine.pool_memory import PoolMemory
    from omlx.engine.residents import Residents

log = logging.getLogger(__name__)


class ReleasedTags:
    """What is released: tags for every model (an unscoped release), tags per model
    (a release naming one), and the models to load back. Changed by ``Releases``;
    read by the residents, which load nothing released."""

    def __init__(self) -> None:
        self.everywhere: set[str] = set()
        self.by_model: dict[str, set[str]] = {}
        # Models a release of "weights" unloaded, in the order they go back.
        self.to_reload: list[str] = []

    def tags_for(self, name: str) -> set[str]:
        return self.everywhere | self.by_model.get(name, set())

    def all_tags(self) -> set[str]:
        return self.everywhere.union(*self.by_model.values())

    def refuse_if_released(self, name: str) -> None:
        tags = self.tags_for(name)
        if tags:
            raise MemoryPressureError(
                f"memory is released for '{name}' ({', '.join(sorted(tags))}); POST "
                "/resume_memory_occupation to serve again",
                retry_after_s=5,
            )

    def forget_empty(self) -> None:
        self.by_model = {name: held for name, held in self.by_model.items() if held}

    def by_model_report(self) -> dict[str, list[str]]:
        return {name: sorted(held) for name, held in sorted(self.by_model.items())}


class Releases:
    """Release and resume, over the residents' public interface. ``tags`` is the
    state shared with the residents (what is released)."""

    def __init__(
        self,
        tags: ReleasedTags,
        residents: Residents,
        catalog: ModelCatalog,
        memory: PoolMemory,
    ) -> None:
        self.tags = tags
        self._residents = residents
        self._catalog = catalog
        self._memory = memory
        self._lock = asyncio.Lock()

    async def release(self, tags: set[str], model: str | None, timeout_s: float) -> dict[str, Any]:
        """Quiesce (no new work; wait for requests in flight or leased up to
        ``timeout_s``, then end them with a clear error) and free the tagged memory.
        A load in progress finishes first and is released with the rest."""
        released, residents = self.tags, self._residents
        async with self._lock:
            # Marked before waiting for loads: no new requests and no new loads from here.
            name = self._catalog.resolve(model).name if model else None
            held = (
                released.everywhere if name is None else released.by_model.setdefault(name, set())
            )
            newly = tags - held
            held |= tags
            async with residents.room():  # waits for a load in progress
                if name is None:
                    names = residents.names()
                elif residents.get(name) is not None:
                    names = [name]
                else:
                    held -= newly
                    released.forget_empty()
                    raise InvalidRequestError(f"model '{model}' is not loaded", param="model")
                return await self._release_models(tags, names, timeout_s, name)

    async def _release_models(
        self, tags: set[str], names: list[str], timeout_s: float, scoped: str | None
    ) -> dict[str, Any]:
        residents = self._residents
        before = self._memory.probe.reading(fresh=True).resident_bytes
        ended = await self._quiesce(names, timeout_s)
        failed: dict[str, str] = {}
        if "kv_cache" in tags:
            await self._drop_ram_cache(names, every_model=scoped is None)
        if "weights" in tags:
            failed = await self._unload_each(names)
            gone = [n for n in names if residents.get(n) is None]
            self.tags.to_reload += [n for n in gone if n not in self.tags.to_reload]
        await residents.run_on_worker(mlx_stats.release_cache)
        after = self._memory.probe.reading(fresh=True).resident_bytes
        log.info(
            "released %s of %s: %s freed, %d requests ended%s",
            ",".join(sorted(tags)),
            ", ".join(names) or "no model",
            format_bytes(max(0, before - after)),
            ended,
            f"; NOT released: {failed}" if failed else "",
        )
        return {
            "released": sorted(self.tags.all_tags()),
            "released_by_model": self.tags.by_model_report(),
            "models": [n for n in names if n not in failed],
            "failed": failed,
            "requests_ended": ended,
            "bytes_before": before,
            "bytes_after": after,
            "bytes_freed": max(0, before - after),
        }

    async def _quiesce(self, names: list[str], timeout_s: float) -> int:
        """Wait for busy requests up to ``timeout_s``; refuse new ones, end the rest."""
        residents = self._residents
        engines = [e for e in map(residents.engine, names) if e is not None]
        await residents.drain(names, timeout_s)
        error = MemoryPressureError("memory is being released; retry after it is resumed")
        ended = 0
        for engine in engines:
            # A request still between fetch and submit is refused when it submits.
            engine.refuse_new(error)
            if engine.num_in_flight:
                ended += await residents.run_on_worker(engine.fail_all, error)
        return ended

    async def _drop_ram_cache(self, names: list[str], *, every_model: bool) -> None:
        """The released models' RAM blocks, dropped on the MLX thread after the
        stores of the requests that just ended (answered before the release, or
        ended by it), on every rank of a split model; with ``every_model`` the
        blocks of models not loaded too."""
        hot_cache = self._memory.hot_cache
        if hot_cache is None:
            return
        engines = [e for e in map(self._residents.engine, names) if e is not None]
        cached = [e for e in engines if e.prefix_cache is not None]
        await self._residents.run_on_worker(_clear_ram_tier, cached)
        if every_model:
            hot_cache.clear(tier="hot")

    async def _unload_each(self, names: list[str]) -> dict[str, str]:
        """Unload every model; one failing does not stop the others. Returns what failed."""
        error = MemoryPressureError("memory is being released; retry after it is resumed")
        failed: dict[str, str] = {}
        for name in names:
            try:
                await self._residents.unload(name, error=error)
            except Exception as exc:
                log.exception("release: unloading %s failed", name)
                state = "still loaded" if self._residents.get(name) else "unloaded"
                failed[name] = f"{type(exc).__name__}: {exc} ({state})"
        return failed

    async def resume(self, tags: set[str], model: str | None) -> dict[str, Any]:
        """Take back ``tags`` (for every model, or only those released for ``model``);
        models no longer blocked serve again, and those unloaded are loaded back."""
        released, residents = self.tags, self._residents
        async with self._lock:
            if model is None:
                released.everywhere -= tags
                for held in released.by_model.values():
                    held -= tags
            else:
                name = self._catalog.resolve(model).name
                released.by_model.get(name, set()).difference_update(tags)
            released.forget_empty()
            for name in residents.names():
                engine = residents.engine(name)
                if engine is not None and not released.tags_for(name):
                    engine.refuse_new(None)
            loaded = []
            # Still blocked: stays on the list and loads back when everything is resumed,
            # not now (weights that cannot serve would only hold memory).
            for name in [n for n in released.to_reload if not released.tags_for(n)]:
                await residents.acquire(self._catalog.resolve(name))
                released.to_reload.remove(name)
                loaded.append(name)
            return {
                "released": sorted(released.all_tags()),
                "released_by_model": released.by_model_report(),
                "models_loaded": loaded,
                "models_to_reload": list(released.to_reload),
            }


def _clear_ram_tier(engines: list[Any]) -> None:
    for engine in engines:
        engine.clear_prefix_cache("hot")
