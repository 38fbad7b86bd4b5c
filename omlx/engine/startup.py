"""Models loaded in the background when the server starts, and their readiness.

Without this the first request paid for the load, the auto-profile and the
compiled-step proofs while ``/health`` already said ok. At start the pool loads
the pinned models, then the default model (per-model ``is_default``, else
``models.default_model``; with neither set and exactly one model present, that
one: it is the model every request will ask for). ``models.load_at_start: false``
turns this off. A request for a model still loading waits for that load (the
pool's per-model load lock); it never starts a second one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omlx.errors import OmlxError

if TYPE_CHECKING:
    from omlx.engine.catalog import ModelCatalog
    from omlx.engine.residents import Residents

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Outcome:
    state: str  # "loading", "ready" or "failed"
    reason: str = ""
    seconds: float | None = None


class StartupLoads:
    """The background loads begun at start and what became of each. ``load_facts``:
    how a loaded model became ready (the engine builder's)."""

    def __init__(
        self,
        catalog: ModelCatalog,
        residents: Residents,
        load_facts: Callable[[str], dict[str, Any]],
    ) -> None:
        self._catalog = catalog
        self._residents = residents
        self._load_facts = load_facts
        self._outcomes: dict[str, _Outcome] = {}
        self._task: asyncio.Task[None] | None = None

    def names(self) -> list[str]:
        """Which models to load at start: pinned ones first, then the default."""
        catalog = self._catalog
        if not catalog.settings.models.load_at_start:
            return []
        models = catalog.available()
        names = [n for n in sorted(models) if catalog.pinned(n)]
        default = catalog.default_model()
        if default is None and len(models) == 1:
            default = next(iter(models))
        if default is not None and default not in names:
            names.append(default)
        return names

    def begin(self) -> None:
        """Start loading on the running event loop; returns at once."""
        names = self.names()
        if not names:
            return
        log.info("loading at start, in the background: %s", ", ".join(names))
        for name in names:
            self._outcomes[name] = _Outcome("loading")
        self._task = asyncio.create_task(self._load_all(names), name="startup-loads")

    async def _load_all(self, names: list[str]) -> None:
        # One after another: the pool makes room for one load at a time anyway.
        for name in names:
            await self._load_one(name)

    async def _load_one(self, name: str) -> None:
        started = time.monotonic()
        try:
            await self._residents.acquire(self._catalog.resolve(name))
        except OmlxError as exc:
            self._failed(name, exc.message)
        except Exception as exc:  # a broken model folder must not end the server
            log.exception("loading %s at start failed", name)
            self._failed(name, f"{type(exc).__name__}: {exc}")
        else:
            seconds = time.monotonic() - started
            self._outcomes[name] = _Outcome("ready", seconds=round(seconds, 3))
            log.info("%s is ready (loaded at start in %.1f s)", name, seconds)

    def _failed(self, name: str, reason: str) -> None:
        self._outcomes[name] = _Outcome("failed", reason=reason)
        log.error("loading %s at start failed: %s", name, reason)

    async def cancel(self) -> None:
        """At shutdown: stop loading what has not started (a load on the MLX thread
        finishes there; the pool's close then unloads it)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def report(self) -> dict[str, Any]:
        """Per model ``loading`` / ``ready`` / ``failed`` (with the reason) and the
        overall state: loading while any is, else failed when any failed, else ready."""
        residents = self._residents
        models = []
        loading = residents.loading_names()
        names = list(self._outcomes) + [n for n in loading if n not in self._outcomes]
        names += [n for n in residents.names() + residents.failed_names() if n not in names]
        for name in names:
            models.append({"name": name, **self._state_of(name)})
        states = {m["state"] for m in models}
        overall = next((s for s in ("loading", "failed") if s in states), "ready")
        return {"models_state": overall, "models": models}

    def _state_of(self, name: str) -> dict[str, Any]:
        outcome = self._outcomes.get(name)
        loading = name in self._residents.loading_names()
        if loading or (outcome is not None and outcome.state == "loading"):
            return {"state": "loading"}
        if self._residents.engine(name) is not None:
            seconds = outcome.seconds if outcome is not None else None
            return {"state": "ready", "load_seconds": seconds, **self._load_facts(name)}
        if outcome is not None and outcome.state == "failed":
            return {"state": "failed", "reason": outcome.reason}
        reason = self._residents.failure(name)  # a load on request that failed
        return {"state": "failed", "reason": reason} if reason else {"state": "unloaded"}
