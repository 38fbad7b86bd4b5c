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
    from omlx.engine.pool import EnginePool, _Resident

log = logging.getLogger(__name__)


class Releases:
    """What is released, owned by the pool: tags for every model (an unscoped
    release), tags per model (a release naming one), and the models to load back."""

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool
        self.everywhere: set[str] = set()
        self.by_model: dict[str, set[str]] = {}
        # Models a release of "weights" unloaded, in the order they go back.
        self.to_reload: list[str] = []
        self._lock = asyncio.Lock()

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

    async def release(self, tags: set[str], model: str | None, timeout_s: float) -> dict[str, Any]:
        """Quiesce (no new work; wait for requests in flight or leased up to
        ``timeout_s``, then end them with a clear error) and free the tagged memory.
        A load in progress finishes first and is released with the rest."""
        pool = self._pool
        async with self._lock:
            # Marked before waiting for loads: no new requests and no new loads from here.
            name = pool.resolve(model).name if model else None
            held = self.everywhere if name is None else self.by_model.setdefault(name, set())
            newly = tags - held
            held |= tags
            async with pool._room_lock:  # waits for a load in progress
                if name is None:
                    names = list(pool._resident)
                elif name in pool._resident:
                    names = [name]
                else:
                    held -= newly
                    self._forget_empty()
                    raise InvalidRequestError(f"model '{model}' is not loaded", param="model")
                return await self._release_models(tags, names, timeout_s, name)

    async def _release_models(
        self, tags: set[str], names: list[str], timeout_s: float, scoped: str | None
    ) -> dict[str, Any]:
        pool = self._pool
        before = pool.probe.reading(fresh=True).resident_bytes
        residents = [pool._resident[n] for n in names]
        ended = await self._quiesce(residents, timeout_s)
        failed: dict[str, str] = {}
        if "kv_cache" in tags:
            await self._drop_ram_cache(residents, every_model=scoped is None)
        if "weights" in tags:
            failed = await self._unload_each(names)
            gone = [n for n in names if n not in pool._resident]
            self.to_reload += [n for n in gone if n not in self.to_reload]
        await asyncio.wrap_future(pool._worker.submit(mlx_stats.release_cache))
        after = pool.probe.reading(fresh=True).resident_bytes
        log.info(
            "released %s of %s: %s freed, %d requests ended%s",
            ",".join(sorted(tags)),
            ", ".join(names) or "no model",
            format_bytes(max(0, before - after)),
            ended,
            f"; NOT released: {failed}" if failed else "",
        )
        return {
            "released": sorted(self.all_tags()),
            "released_by_model": self._by_model_report(),
            "models": [n for n in names if n not in failed],
            "failed": failed,
            "requests_ended": ended,
            "bytes_before": before,
            "bytes_after": after,
            "bytes_freed": max(0, before - after),
        }

    async def _quiesce(self, residents: list[_Resident], timeout_s: float) -> int:
        """Wait for busy requests up to ``timeout_s``; refuse new ones, end the rest."""
        pool = self._pool
        deadline = pool._clock() + timeout_s
        while any(r.busy for r in residents) and pool._clock() < deadline:
            await asyncio.sleep(0.05)
        error = MemoryPressureError("memory is being released; retry after it is resumed")
        ended = 0
        for resident in residents:
            # A request still between fetch and submit is refused when it submits.
            resident.engine.refuse_new(error)
            if resident.engine.num_in_flight:
                future = pool._worker.submit(resident.engine.fail_all, error)
                ended += await asyncio.wrap_future(future)
        return ended

    async def _drop_ram_cache(self, residents: list[_Resident], *, every_model: bool) -> None:
        """The released models' RAM blocks, dropped on the MLX thread after the
        stores of the requests that just ended (answered before the release, or
        ended by it), on every rank of a split model; with ``every_model`` the
        blocks of models not loaded too."""
        pool = self._pool
        if pool.hot_cache is None:
            return
        cached = [r.engine for r in residents if r.engine.prefix_cache is not None]
        await asyncio.wrap_future(pool._worker.submit(_clear_ram_tier, cached))
        if every_model:
            pool.hot_cache.clear(tier="hot")

    async def _unload_each(self, names: list[str]) -> dict[str, str]:
        """Unload every model; one failing does not stop the others. Returns what failed."""
        error = MemoryPressureError("memory is being released; retry after it is resumed")
        failed: dict[str, str] = {}
        for name in names:
            try:
                await self._pool.unload(name, error=error)
            except Exception as exc:
                log.exception("release: unloading %s failed", name)
                state = "still loaded" if name in self._pool._resident else "unloaded"
                failed[name] = f"{type(exc).__name__}: {exc} ({state})"
        return failed

    async def resume(self, tags: set[str], model: str | None) -> dict[str, Any]:
        """Take back ``tags`` (for every model, or only those released for ``model``);
        models no longer blocked serve again, and those unloaded are loaded back."""
        pool = self._pool
        async with self._lock:
            if model is None:
                self.everywhere -= tags
                for held in self.by_model.values():
                    held -= tags
            else:
                self.by_model.get(pool.resolve(model).name, set()).difference_update(tags)
            self._forget_empty()
            for name, resident in pool._resident.items():
                if not self.tags_for(name):
                    resident.engine.refuse_new(None)
            loaded = []
            # Still blocked: stays on the list and loads back when everything is resumed,
            # not now (weights that cannot serve would only hold memory).
            for name in [n for n in self.to_reload if not self.tags_for(n)]:
                await pool.get_engine(name)
                self.to_reload.remove(name)
                loaded.append(name)
            return {
                "released": sorted(self.all_tags()),
                "released_by_model": self._by_model_report(),
                "models_loaded": loaded,
                "models_to_reload": list(self.to_reload),
            }

    def _forget_empty(self) -> None:
        self.by_model = {name: held for name, held in self.by_model.items() if held}

    def _by_model_report(self) -> dict[str, list[str]]:
        return {name: sorted(held) for name, held in sorted(self.by_model.items())}


def _clear_ram_tier(engines: list[Any]) -> None:
    for engine in engines:
        engine.clear_prefix_cache("hot")
