"""The RAM tier of the prefix cache: one byte budget and one LRU for every loaded model.

Holds ``BlockPayload`` bytes, like the SSD tier, so it never imports mlx. Each
model may attach its own ``SSDStore``; the mode says how the two tiers relate:

- ``write-back``: a block reaches the SSD only when it leaves RAM (evicted,
  too large for the budget, or its model detached).
- ``write-through``: every put is also written to the SSD at once; eviction
  just drops the RAM copy.
- ``hot-only``: the SSD store is never read or written (``clear`` still
  deletes its files when asked).

``SSDStore.put`` can wait up to its put timeout, so blocks are chosen under the
lock and handed to the SSD only after it is released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from omlx.cache.ssd import PUT_TIMEOUT_S as SSD_PUT_TIMEOUT_S
from omlx.cache.ssd import BlockPayload, SSDStore

__all__ = ["HotTier", "HotTierMode", "HotTierStats"]

logger = logging.getLogger(__name__)

HotTierMode = Literal["write-back", "write-through", "hot-only"]
ClearTier = Literal["hot", "ssd", "both"]


@dataclass(frozen=True, slots=True)
class _Policy:
    read_ssd: bool
    write_on_put: bool
    write_on_evict: bool


_POLICIES: dict[str, _Policy] = {
    "write-back": _Policy(read_ssd=True, write_on_put=False, write_on_evict=True),
    "write-through": _Policy(read_ssd=True, write_on_put=True, write_on_evict=False),
    "hot-only": _Policy(read_ssd=False, write_on_put=False, write_on_evict=False),
}


@dataclass(frozen=True, slots=True)
class HotTierStats:
    mode: HotTierMode
    max_bytes: int
    hot_bytes: int
    hot_blocks: int
    num_models: int
    hot_hits: int
    hot_misses: int
    promotions: int
    evictions: int
    oversized: int
    writebacks: int
    writeback_drops: int
    write_throughs: int
    write_through_drops: int


@dataclass(slots=True)
class _Counters:
    hot_hits: int = 0
    hot_misses: int = 0
    promotions: int = 0
    evictions: int = 0
    oversized: int = 0
    writebacks: int = 0
    writeback_drops: int = 0
    write_throughs: int = 0
    write_through_drops: int = 0


@dataclass(frozen=True, slots=True)
class _Entry:
    payload: BlockPayload
    size_bytes: int


# A block chosen under the lock, to be written to ``ssd`` after the lock is released.
_Write = tuple[SSDStore, BlockPayload]


def _payload_bytes(payload: BlockPayload) -> int:
    return sum(len(raw) for _, _, raw in payload.tensors.values())


class HotTier:
    """An LRU of KV blocks in RAM under one byte budget shared by all attached models."""

    def __init__(self, max_bytes: int, *, mode: HotTierMode = "write-back"):
        if mode not in _POLICIES:
            raise ValueError(f"mode must be one of {sorted(_POLICIES)}, got {mode!r}")
        self._mode: HotTierMode = mode
        self._policy = _POLICIES[mode]
        self._max_bytes = _check_budget(max_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[tuple[str, str], _Entry] = OrderedDict()  # LRU first
        self._hot_bytes = 0
        self._stores: dict[str, SSDStore | None] = {}
        self._counters = _Counters()

    # -- models -----------------------------------------------------------

    def attach(self, model_identity: str, ssd: SSDStore | None) -> None:
        """Register a model and its SSD store (None: RAM only). The caller owns the store.

        Raises ValueError if the store belongs to another model, or if the model
        is already attached to a different store.
        """
        if ssd is not None and ssd.spec.model_identity != model_identity:
            raise ValueError(
                f"SSD store for {ssd.spec.model_identity!r} cannot serve {model_identity!r}"
            )
        with self._lock:
            if model_identity in self._stores and self._stores[model_identity] is not ssd:
                raise ValueError(f"{model_identity!r} is already attached; detach it first")
            self._stores[model_identity] = ssd

    def detach(self, model_identity: str, *, deadline_s: float | None = None) -> None:
        """Forget a model and drop its hot blocks. In write-back mode they are first
        handed to its SSD store, oldest first; the puts share one wait for a full
        writer queue, until ``deadline_s`` (default: one put timeout from now), and
        what does not fit by then is dropped (counted). The store is not closed."""
        with self._lock:
            ssd = self._stores.pop(model_identity, None)
            entries = self._pop_model_locked(model_identity)
        if ssd is not None and self._policy.write_on_evict:
            if deadline_s is None:
                deadline_s = time.monotonic() + SSD_PUT_TIMEOUT_S
            self._write_back([(ssd, e.payload) for e in entries], deadline_s)

    # -- blocks -----------------------------------------------------------

    def put(self, payload: BlockPayload, *, deadline_s: float | None = None) -> None:
        """Keep ``payload`` in RAM as the most recently used block, evicting LRU blocks
        of any model to stay within budget. A block larger than the whole budget is
        not kept (write-back hands it straight to the SSD). SSD puts wait no later
        than ``deadline_s`` (see ``SSDStore.put``). Raises ValueError for a model
        that is not attached or a payload its SSD store cannot hold."""
        model = payload.model_identity
        size_bytes = _payload_bytes(payload)
        with self._lock:
            if model not in self._stores:
                raise ValueError(f"{model!r} is not attached to the hot tier")
            ssd = self._stores[model]
            if ssd is not None and self._policy.read_ssd:
                ssd.spec.check_payload(payload)
            self._remove_locked((model, payload.key))
            if size_bytes > self._max_bytes:
                self._counters.oversized += 1
                evicted = [(ssd, payload)] if ssd is not None else []
            else:
                self._insert_locked(payload, size_bytes)
                evicted = self._evict_locked()
        if ssd is not None and self._policy.write_on_put:
            self._write_through(ssd, payload, deadline_s)
        if self._policy.write_on_evict:
            self._write_back(evicted, deadline_s)

    def get(
        self, model_identity: str, key: str, *, deadline_s: float | None = None
    ) -> BlockPayload | None:
        """Return the block from RAM, else from the model's SSD store (promoting it into
        RAM, which may evict others to the SSD, waiting no later than ``deadline_s``:
        the blocks of one prefix hit share it), else None. The SSD store counts its
        own hits."""
        with self._lock:
            entry = self._index.get((model_identity, key))
            if entry is not None:
                self._index.move_to_end((model_identity, key))
                self._counters.hot_hits += 1
                return entry.payload
            self._counters.hot_misses += 1
            ssd = self._stores.get(model_identity) if self._policy.read_ssd else None
        if ssd is None:
            return None
        payload = ssd.get(key)  # disk read, outside the lock
        if payload is None:
            return None
        self._promote(ssd, payload, deadline_s)
        return payload

    def contains(self, model_identity: str, key: str) -> bool:
        with self._lock:
            if (model_identity, key) in self._index:
                return True
            ssd = self._stores.get(model_identity) if self._policy.read_ssd else None
        return ssd is not None and ssd.contains(key)

    def clear(self, model_identity: str | None = None, *, tier: ClearTier = "hot") -> None:
        """Drop blocks of one model (or all). ``tier="hot"`` discards RAM copies without
        writing them back; ``"ssd"`` clears the attached SSD stores; ``"both"`` does both."""
        if tier not in ("hot", "ssd", "both"):
            raise ValueError(f"tier must be 'hot', 'ssd' or 'both', got {tier!r}")
        with self._lock:
            if tier in ("hot", "both"):
                if model_identity is None:
                    self._index.clear()
                    self._hot_bytes = 0
                else:
                    self._pop_model_locked(model_identity)
            models = list(self._stores) if model_identity is None else [model_identity]
            stores = [s for m in models if (s := self._stores.get(m)) is not None]
        if tier in ("ssd", "both"):
            for ssd in stores:
                ssd.clear()

    def stats(self) -> HotTierStats:
        with self._lock:
            c = self._counters
            return HotTierStats(
                mode=self._mode,
                max_bytes=self._max_bytes,
                hot_bytes=self._hot_bytes,
                hot_blocks=len(self._index),
                num_models=len(self._stores),
                hot_hits=c.hot_hits,
                hot_misses=c.hot_misses,
                promotions=c.promotions,
                evictions=c.evictions,
                oversized=c.oversized,
                writebacks=c.writebacks,
                writeback_drops=c.writeback_drops,
                write_throughs=c.write_throughs,
                write_through_drops=c.write_through_drops,
            )

    # -- internals --------------------------------------------------------

    def _promote(self, ssd: SSDStore, payload: BlockPayload, deadline_s: float | None) -> None:
        key = (payload.model_identity, payload.key)
        size_bytes = _payload_bytes(payload)
        with self._lock:
            # The model may have been detached or re-attached while we read the disk.
            if self._stores.get(payload.model_identity) is not ssd:
                return
            if key in self._index:  # put meanwhile
                self._index.move_to_end(key)
                return
            if size_bytes > self._max_bytes:
                return
            self._insert_locked(payload, size_bytes)
            self._counters.promotions += 1
            evicted = self._evict_locked()
        if self._policy.write_on_evict:
            self._write_back(evicted, deadline_s)

    def _insert_locked(self, payload: BlockPayload, size_bytes: int) -> None:
        self._index[(payload.model_identity, payload.key)] = _Entry(payload, size_bytes)
        self._hot_bytes += size_bytes

    def _remove_locked(self, key: tuple[str, str]) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._hot_bytes -= entry.size_bytes

    def _evict_locked(self) -> list[_Write]:
        """Pop LRU blocks until within budget; return those that have an SSD store."""
        evicted: list[_Write] = []
        while self._hot_bytes > self._max_bytes:
            (model, _), entry = self._index.popitem(last=False)
            self._hot_bytes -= entry.size_bytes
            self._counters.evictions += 1
            ssd = self._stores.get(model)
            if ssd is not None:
                evicted.append((ssd, entry.payload))
        return evicted

    def _pop_model_locked(self, model_identity: str) -> list[_Entry]:
        keys = [k for k in self._index if k[0] == model_identity]
        entries = [self._index.pop(k) for k in keys]
        self._hot_bytes -= sum(e.size_bytes for e in entries)
        return entries

    def _write_back(self, writes: list[_Write], deadline_s: float | None = None) -> None:
        """Hand blocks to their SSD stores. Must be called without the lock held."""
        for ssd, payload in writes:
            try:
                accepted = ssd.put(payload, deadline_s=deadline_s)
            except ValueError as e:  # one refused block must not lose the others
                logger.warning("hot cache: SSD store refused block %s: %s", payload.key, e)
                accepted = False
            with self._lock:
                if accepted:
                    self._counters.writebacks += 1
                else:
                    self._counters.writeback_drops += 1

    def _write_through(
        self, ssd: SSDStore, payload: BlockPayload, deadline_s: float | None
    ) -> None:
        accepted = ssd.put(payload, deadline_s=deadline_s)
        with self._lock:
            if accepted:
                self._counters.write_throughs += 1
            else:
                self._counters.write_through_drops += 1


def _check_budget(max_bytes: int) -> int:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    return max_bytes
