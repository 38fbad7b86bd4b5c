"""HotTier: one RAM budget over every model, in front of real SSDStores on tmp dirs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omlx.cache.hot import HotTier
from omlx.cache.ssd import MARKER_NAME, BlockPayload, SSDStore
from tests.fixtures.ssd_gate import Gate
from tests.fixtures.waiting import wait_until

MODEL_A = "model-a@1"
MODEL_B = "model-b@1"
LAYOUT = ("KVCache",)
BLOCK_SIZE = 4
BLOCK_BYTES = 100  # tensor bytes of one make_payload block: what the hot tier counts


def make_payload(i: int, model: str = MODEL_A) -> BlockPayload:
    tensors = {"layers.0.keys": ("F16", (50,), bytes([i % 256]) * BLOCK_BYTES)}
    return BlockPayload(f"{i:016x}", model, BLOCK_SIZE, BLOCK_SIZE, LAYOUT, tensors)


class Stores:
    """Real SSDStores, one directory per model, closed at teardown."""

    def __init__(self, root: Path):
        self.root = root
        self.opened: list[SSDStore] = []

    def open(self, model: str, **kwargs: object) -> SSDStore:
        store = SSDStore(
            self.root / model,
            model_identity=model,
            layer_layout=LAYOUT,
            block_size=BLOCK_SIZE,
            max_size_bytes=1 << 30,
            **kwargs,  # type: ignore[arg-type]
        )
        self.opened.append(store)
        return store


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Stores]:
    s = Stores(tmp_path)
    yield s
    for store in s.opened:
        store.close()


def hot_with_stores(stores: Stores, max_blocks: int, mode: str) -> tuple[HotTier, SSDStore]:
    hot = HotTier(max_blocks * BLOCK_BYTES, mode=mode)  # type: ignore[arg-type]
    ssd = stores.open(MODEL_A)
    hot.attach(MODEL_A, ssd)
    return hot, ssd


# -- RAM only ---------------------------------------------------------------


def test_put_get_round_trip_and_counters() -> None:
    hot = HotTier(10 * BLOCK_BYTES)
    hot.attach(MODEL_A, None)
    payload = make_payload(1)
    hot.put(payload)
    assert hot.get(MODEL_A, payload.key) == payload
    assert hot.contains(MODEL_A, payload.key)
    assert not hot.contains(MODEL_B, payload.key)
    assert hot.get(MODEL_A, make_payload(2).key) is None
    assert hot.get(MODEL_B, payload.key) is None  # keys are per model
    stats = hot.stats()
    assert (stats.hot_hits, stats.hot_misses) == (1, 2)
    assert (stats.hot_bytes, stats.hot_blocks, stats.num_models) == (BLOCK_BYTES, 1, 1)
    assert (stats.mode, stats.max_bytes) == ("write-back", 10 * BLOCK_BYTES)


def test_put_again_replaces_without_double_counting() -> None:
    hot = HotTier(10 * BLOCK_BYTES)
    hot.attach(MODEL_A, None)
    hot.put(make_payload(1))
    hot.put(make_payload(1))
    assert (hot.stats().hot_bytes, hot.stats().hot_blocks) == (BLOCK_BYTES, 1)


def test_lru_eviction_spans_models_under_one_budget() -> None:
    hot = HotTier(3 * BLOCK_BYTES)
    hot.attach(MODEL_A, None)
    hot.attach(MODEL_B, None)
    a0, b0, a1 = make_payload(0, MODEL_A), make_payload(0, MODEL_B), make_payload(1, MODEL_A)
    for p in (a0, b0, a1):
        hot.put(p)
    assert hot.get(MODEL_A, a0.key) == a0  # now b0 is the least recently used
    hot.put(make_payload(1, MODEL_B))
    assert not hot.contains(MODEL_B, b0.key)
    assert hot.contains(MODEL_A, a0.key) and hot.contains(MODEL_A, a1.key)
    hot.put(make_payload(2, MODEL_A))  # a1 is next
    assert not hot.contains(MODEL_A, a1.key)
    assert hot.contains(MODEL_A, a0.key)
    stats = hot.stats()
    assert (stats.evictions, stats.hot_bytes, stats.hot_blocks) == (2, 3 * BLOCK_BYTES, 3)


def test_put_for_an_unattached_model_raises() -> None:
    hot = HotTier(10 * BLOCK_BYTES)
    with pytest.raises(ValueError, match="not attached"):
        hot.put(make_payload(1))


def test_attach_checks_the_store(stores: Stores) -> None:
    hot = HotTier(10 * BLOCK_BYTES)
    ssd_a = stores.open(MODEL_A)
    with pytest.raises(ValueError, match="cannot serve"):
        hot.attach(MODEL_B, ssd_a)
    hot.attach(MODEL_A, ssd_a)
    hot.attach(MODEL_A, ssd_a)  # the same store again is fine
    with pytest.raises(ValueError, match="already attached"):
        hot.attach(MODEL_A, None)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_budgets_and_modes_raise(bad: object) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        HotTier(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        HotTier(100, mode="write-around")  # type: ignore[arg-type]


# -- write-back ---------------------------------------------------------------


def test_write_back_persists_evicted_blocks_and_promotes_them_back(stores: Stores) -> None:
    hot, ssd = hot_with_stores(stores, 2, "write-back")
    p0, p1, p2 = make_payload(0), make_payload(1), make_payload(2)
    hot.put(p0)
    hot.put(p1)
    assert ssd.flush() and ssd.keys() == []  # nothing reaches the SSD before eviction
    hot.put(p2)
    assert ssd.flush()
    assert ssd.keys() == [p0.key]
    assert (hot.stats().evictions, hot.stats().writebacks) == (1, 1)

    assert hot.get(MODEL_A, p0.key) == p0  # from the SSD, promoted; p1 is evicted for it
    assert ssd.flush()
    assert sorted(ssd.keys()) == sorted([p0.key, p1.key])
    assert hot.get(MODEL_A, p0.key) == p0  # now a hot hit
    stats = hot.stats()
    assert (stats.promotions, stats.evictions, stats.writebacks) == (1, 2, 2)
    assert (stats.hot_hits, stats.hot_misses, stats.hot_blocks) == (1, 1, 2)
    assert ssd.stats().hits == 1


def test_ssd_miss_is_not_promoted(stores: Stores) -> None:
    hot, ssd = hot_with_stores(stores, 2, "write-back")
    assert hot.get(MODEL_A, make_payload(9).key) is None
    assert (hot.stats().promotions, hot.stats().hot_misses, ssd.stats().misses) == (0, 1, 1)


def test_oversized_block_goes_straight_to_ssd_in_write_back(stores: Stores) -> None:
    hot = HotTier(BLOCK_BYTES // 2)
    ssd = stores.open(MODEL_A)
    hot.attach(MODEL_A, ssd)
    payload = make_payload(1)
    hot.put(payload)
    stats = hot.stats()
    assert (stats.hot_blocks, stats.hot_bytes, stats.oversized, stats.writebacks) == (0, 0, 1, 1)
    assert ssd.flush() and ssd.keys() == [payload.key]
    assert hot.get(MODEL_A, payload.key) == payload  # served from SSD, still too big to promote
    assert (hot.stats().promotions, hot.stats().hot_blocks) == (0, 0)


def test_oversized_block_is_dropped_in_hot_only(stores: Stores) -> None:
    hot, ssd = hot_with_stores(stores, 0, "hot-only")
    hot.put(make_payload(1))
    assert (hot.stats().oversized, hot.stats().hot_blocks, hot.stats().writebacks) == (1, 0, 0)
    assert ssd.flush() and ssd.stats().saves == 0


def test_detach_in_write_back_persists_only_that_models_blocks(stores: Stores) -> None:
    hot, ssd_a = hot_with_stores(stores, 10, "write-back")
    ssd_b = stores.open(MODEL_B)
    hot.attach(MODEL_B, ssd_b)
    a0, a1, b0 = make_payload(0), make_payload(1), make_payload(0, MODEL_B)
    for p in (a0, a1, b0):
        hot.put(p)
    hot.detach(MODEL_A)
    assert ssd_a.flush() and ssd_a.keys() == [a0.key, a1.key]  # oldest first
    assert ssd_b.flush() and ssd_b.keys() == []
    stats = hot.stats()
    assert (stats.hot_blocks, stats.hot_bytes, stats.num_models, stats.writebacks) == (
        1,
        BLOCK_BYTES,
        1,
        2,
    )
    assert hot.get(MODEL_A, a0.key) is None  # detached: not read from its old store
    with pytest.raises(ValueError, match="not attached"):
        hot.put(a0)


def test_writeback_drop_is_counted_when_the_store_refuses(stores: Stores) -> None:
    hot, ssd = hot_with_stores(stores, 1, "write-back")
    ssd.close()  # a closed store drops every put
    hot.put(make_payload(0))
    hot.put(make_payload(1))
    assert (hot.stats().writebacks, hot.stats().writeback_drops) == (0, 1)


# -- write-through and hot-only -----------------------------------------------


def test_write_through_persists_on_put_and_eviction_writes_nothing(stores: Stores) -> None:
    hot, ssd = hot_with_stores(stores, 2, "write-through")
    p0 = make_payload(0)
    hot.put(p0)
    assert ssd.flush() and ssd.keys() == [p0.key]
    hot.put(make_payload(1))
    hot.put(make_payload(2))  # evicts p0
    assert ssd.flush()
    stats = hot.stats()
    assert (stats.evictions, stats.writebacks, stats.write_throughs) == (1, 0, 3)
    assert ssd.stats().saves == 3  # eviction did not put p0 again
    assert hot.get(MODEL_A, p0.key) == p0
    assert hot.stats().promotions == 1
    assert ssd.stats().saves == 3


def test_hot_only_never_touches_the_ssd(stores: Stores) -> None:
    hot, ssd = hot_with_stores(stores, 1, "hot-only")
    p0 = make_payload(0)
    hot.put(p0)
    hot.put(make_payload(1))  # evicts p0
    assert hot.get(MODEL_A, p0.key) is None
    assert not hot.contains(MODEL_A, p0.key)
    hot.detach(MODEL_A)
    assert ssd.flush()
    # Only the folder's omlx marker, written when the store opened: no block, no temp file.
    assert [p.name for p in ssd.cache_dir.iterdir()] == [MARKER_NAME]
    ssd_stats = ssd.stats()
    assert (ssd_stats.saves, ssd_stats.hits, ssd_stats.misses) == (0, 0, 0)
    stats = hot.stats()
    assert (stats.evictions, stats.writebacks, stats.write_throughs) == (1, 0, 0)


# -- clear --------------------------------------------------------------------


def test_clear_by_tier_and_model(stores: Stores) -> None:
    hot, ssd_a = hot_with_stores(stores, 10, "write-through")
    ssd_b = stores.open(MODEL_B)
    hot.attach(MODEL_B, ssd_b)
    a0, b0 = make_payload(0), make_payload(0, MODEL_B)
    hot.put(a0)
    hot.put(b0)
    assert ssd_a.flush() and ssd_b.flush()

    hot.clear(MODEL_A)  # default tier: RAM only
    assert hot.stats().hot_blocks == 1 and hot.stats().hot_bytes == BLOCK_BYTES
    assert ssd_a.keys() == [a0.key]
    assert hot.contains(MODEL_A, a0.key)  # still on the SSD

    hot.clear(MODEL_A, tier="ssd")
    assert not hot.contains(MODEL_A, a0.key)
    assert ssd_b.keys() == [b0.key]

    hot.clear(tier="both")
    assert hot.stats().hot_blocks == 0 and hot.stats().hot_bytes == 0
    assert ssd_b.keys() == [] and not hot.contains(MODEL_B, b0.key)
    with pytest.raises(ValueError, match="tier"):
        hot.clear(tier="disk")  # type: ignore[arg-type]


def test_clear_hot_in_write_back_discards_without_writing(stores: Stores) -> None:
    hot, ssd = hot_with_stores(stores, 10, "write-back")
    hot.put(make_payload(0))
    hot.clear()
    assert hot.stats().hot_blocks == 0 and hot.stats().writebacks == 0
    assert ssd.flush() and ssd.keys() == []


# -- locking --------------------------------------------------------------------


def test_a_blocked_write_back_does_not_hold_the_lock(stores: Stores) -> None:
    """A write-back stuck in SSDStore.put (writer busy, queue full) must not stall other
    callers: a hot get on another key returns at once while the put is still waiting."""
    ssd = stores.open(MODEL_A, queue_size=1, put_timeout_s=3.0)
    gate = Gate(ssd)
    assert ssd.put(make_payload(100))  # the writer takes it and waits at the gate
    assert gate.entered.wait(5)
    assert ssd.put(make_payload(101))  # fills the one-slot queue
    hot = HotTier(2 * BLOCK_BYTES)
    hot.attach(MODEL_A, ssd)
    p0, p1 = make_payload(0), make_payload(1)
    hot.put(p0)
    hot.put(p1)

    evicting = threading.Thread(target=hot.put, args=(make_payload(2),))
    evicting.start()
    wait_until(lambda: hot.stats().evictions == 1)  # p0 chosen; its ssd.put now waits
    time.sleep(0.05)
    started = time.monotonic()
    assert hot.get(MODEL_A, p1.key) == p1
    hot.stats()
    elapsed_s = time.monotonic() - started
    assert evicting.is_alive(), "the write-back should still be waiting for queue space"
    assert elapsed_s < 0.5

    gate.release()
    evicting.join(5)
    assert not evicting.is_alive()
    assert (hot.stats().writebacks, hot.stats().writeback_drops) == (1, 0)
    assert ssd.flush() and ssd.contains(p0.key)


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_burst_into_a_full_queue_stalls_once_not_once_per_block(
    stores: Stores, mode: str
) -> None:
    """The MLX thread stores a request's blocks in one call: with the SSD writer
    stuck, the burst shares one put timeout and the rest drop (counted)."""
    hot = HotTier(1 * BLOCK_BYTES if mode == "write-back" else 100 * BLOCK_BYTES, mode=mode)  # type: ignore[arg-type]
    ssd = stores.open(MODEL_A, queue_size=1)
    hot.attach(MODEL_A, ssd)
    gate = Gate(ssd)
    try:
        hot.put(make_payload(0))
        hot.put(make_payload(1))
        if mode == "write-through":
            assert gate.entered.wait(5)
        hot.put(make_payload(2))  # in write-back the writer now holds a block, one is queued
        assert gate.entered.wait(5)
        drops_before = ssd.stats().drops
        start = time.monotonic()
        deadline = start + 0.25
        for i in range(3, 9):
            hot.put(make_payload(i), deadline_s=deadline)
        waited = time.monotonic() - start
        # One shared wait (0.25 s), not six (1.5 s).
        assert 0.2 <= waited < 0.75
        assert ssd.stats().drops - drops_before == 6
    finally:
        gate.release()


def stuck_store(stores: Stores) -> tuple[SSDStore, Gate]:
    """An SSD store whose writer holds one block and whose one-slot queue is full."""
    ssd = stores.open(MODEL_A, queue_size=1)
    gate = Gate(ssd)
    assert ssd.put(make_payload(100))
    assert gate.entered.wait(5)
    assert ssd.put(make_payload(101))
    return ssd, gate


def test_promotions_of_one_hit_share_one_wait_for_a_full_ssd_queue(stores: Stores) -> None:
    """A prefix hit read from the SSD promotes block after block, each evicting a RAM
    block to the SSD: with the writer stuck they wait once (the hit's deadline), not
    once per block (six x 0.25 s held the MLX thread, and every model, 1.5 s)."""
    on_disk = stores.open(MODEL_A)
    for i in range(10, 16):
        assert on_disk.put(make_payload(i))
    assert on_disk.flush()
    on_disk.close()
    stores.opened.remove(on_disk)
    hot = HotTier(6 * BLOCK_BYTES, mode="write-back")
    ssd, gate = stuck_store(stores)
    hot.attach(MODEL_A, ssd)
    try:
        for i in range(6):
            hot.put(make_payload(i))  # RAM full of blocks the SSD does not have
        start = time.monotonic()
        deadline = start + 0.25
        for i in range(10, 16):
            assert hot.get(MODEL_A, make_payload(i).key, deadline_s=deadline) is not None
        waited = time.monotonic() - start
        assert 0.2 <= waited < 0.75
        assert hot.stats().promotions == 6 and hot.stats().writeback_drops == 6
    finally:
        gate.release()


def test_detach_hands_blocks_back_within_one_wait(stores: Stores) -> None:
    """Unloading a model in write-back mode with the writer stuck: one put timeout in
    all, the blocks that find no room dropped and counted."""
    hot = HotTier(6 * BLOCK_BYTES, mode="write-back")
    ssd, gate = stuck_store(stores)
    hot.attach(MODEL_A, ssd)
    try:
        for i in range(6):
            hot.put(make_payload(i))
        start = time.monotonic()
        hot.detach(MODEL_A)
        waited = time.monotonic() - start
        assert 0.2 <= waited < 0.75
        assert hot.stats().writeback_drops == 6 and hot.stats().hot_blocks == 0
    finally:
        gate.release()
