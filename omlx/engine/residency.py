"""Which loaded models to unload: the pure policy behind the engine pool.

The pool owns the engines and the clock; it hands these functions a snapshot
of what is resident and acts on the names they return. A model is evictable
when it is not pinned and has no request in flight; nothing here ever picks
a pinned or busy model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class ResidentModel:
    name: str
    size_bytes: int
    pinned: bool = False
    in_flight: int = 0
    # Monotonic seconds of the last request start or finish.
    last_used_s: float = 0.0
    # Idle seconds before unloading; None falls back to the global idle timeout.
    ttl_s: float | None = None

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.in_flight == 0


def _least_recent_first(models: Iterable[ResidentModel]) -> list[ResidentModel]:
    # The name breaks ties so the choice does not depend on the snapshot's order.
    return sorted(models, key=lambda m: (m.last_used_s, m.name))


def choose_evictions(
    resident: list[ResidentModel], need_bytes: int, used_bytes: int, budget_bytes: int
) -> list[str] | None:
    """Names to unload, least recently used first, so ``need_bytes`` fits.

    Returns ``[]`` when ``used_bytes + need_bytes <= budget_bytes`` already.
    Otherwise evictable models are taken in LRU order until
    ``used_bytes - freed + need_bytes <= budget_bytes`` and the shortest such
    LRU prefix is returned. Returns ``None`` when even evicting every
    evictable model would not make room: the caller then waits for busy
    models to finish or fails (507); nothing should be unloaded for it.
    """
    if used_bytes + need_bytes <= budget_bytes:
        return []
    chosen: list[str] = []
    freed = 0
    for model in _least_recent_first(m for m in resident if m.evictable):
        chosen.append(model.name)
        freed += model.size_bytes
        if used_bytes - freed + need_bytes <= budget_bytes:
            return chosen
    return None


def _idle_limit_s(model: ResidentModel, global_idle_timeout_s: float | None) -> float | None:
    return model.ttl_s if model.ttl_s is not None else global_idle_timeout_s


def expired(
    resident: list[ResidentModel], now_s: float, global_idle_timeout_s: float | None
) -> list[str]:
    """Names of models idle for at least their time to live, oldest first.

    A model's time to live is its own ``ttl_s``, else ``global_idle_timeout_s``;
    ``None`` for both means it never expires. Pinned models and models with a
    request in flight never expire.
    """
    return [
        m.name
        for m in _least_recent_first(resident)
        if m.evictable
        and (limit := _idle_limit_s(m, global_idle_timeout_s)) is not None
        and now_s - m.last_used_s >= limit
    ]


def next_expiry_s(
    resident: list[ResidentModel], now_s: float, global_idle_timeout_s: float | None
) -> float | None:
    """Seconds from ``now_s`` until the next model expires (0 if one already has).

    ``None`` when no resident model can expire as things stand; a busy model's
    clock restarts when its requests finish, so the pool asks again then.
    """
    waits = [
        max(0.0, m.last_used_s + limit - now_s)
        for m in resident
        if m.evictable and (limit := _idle_limit_s(m, global_idle_timeout_s)) is not None
    ]
    return min(waits, default=None)
