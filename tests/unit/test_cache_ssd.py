"""SSDStore: round trip, restart, corrupt files, and the writer failure modes of seed 001."""

from __future__ import annotations

import errno
import json
import logging
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omlx.cache import safetensors_io
from omlx.cache.ssd import BlockPayload, SSDStore
from tests.fixtures.ssd_gate import Gate

MODEL = "tiny-llama@abc123"
LAYOUT = ("KVCache", "KVCache")
BLOCK_SIZE = 4


def make_payload(i: int, *, model: str = MODEL, block_size: int = BLOCK_SIZE) -> BlockPayload:
    key = f"{i:016x}"
    tensors = {
        f"layers.{layer}.{kind}": ("F16", (1, 2, block_size, 4), bytes([(i + layer) % 256]) * 64)
        for layer in range(len(LAYOUT))
        for kind in ("keys", "values")
    }
    tensors["meta.offset"] = ("I32", (1,), struct.pack("<i", i))
    return BlockPayload(key, model, block_size, block_size, LAYOUT, tensors)


BLOCK_BYTES = 1024  # an upper bound on one make_payload file (860 bytes)


def open_store(path: Path, **kwargs) -> SSDStore:
    kwargs.setdefault("max_size_bytes", 1 << 30)
    kwargs.setdefault("model_identity", MODEL)
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("layer_layout", LAYOUT)
    return SSDStore(path, **kwargs)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SSDStore]:
    s = open_store(tmp_path)
    yield s
    s.close()


def fill(path: Path, n: int, **kwargs) -> list[str]:
    """Write n blocks with a generous budget and close, for a later store to open."""
    s = open_store(path, **kwargs)
    for i in range(n):
        assert s.put(make_payload(i))
        assert s.flush()
        time.sleep(0.002)  # distinct mtimes, so the restart LRU order is defined
    assert s.close()
    return [make_payload(i).key for i in range(n)]


def block_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


# -- round trip, restart, bad files -------------------------------------------


def test_round_trip_returns_identical_bytes_and_metadata(store: SSDStore) -> None:
    payload = make_payload(7)
    assert store.put(payload)
    assert store.flush()
    assert store.contains(payload.key) and store.keys() == [payload.key]
    assert store.get(payload.key) == payload
    assert store.get("ffffffffffffffff") is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.tokens_saved) == (1, 1, payload.num_tokens)
    assert (stats.saves, stats.saves_persisted, stats.num_blocks) == (1, 1, 1)


def test_file_is_readable_by_the_safetensors_package(store: SSDStore) -> None:
    safe_open = pytest.importorskip("safetensors").safe_open
    payload = make_payload(3)
    store.put(payload)
    store.flush()
    (path,) = block_files(store.cache_dir)
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(payload.tensors)
        assert f.metadata()["model_identity"] == MODEL
        assert json.loads(f.metadata()["layer_layout"]) == list(LAYOUT)
        for name, (_, shape, raw) in payload.tensors.items():
            array = f.get_tensor(name)
            assert array.shape == shape and array.tobytes() == raw


def test_restart_rebuilds_index_in_mtime_order_and_serves(tmp_path: Path) -> None:
    keys = fill(tmp_path, 3)
    reopened = open_store(tmp_path)
    try:
        assert reopened.keys() == keys
        assert reopened.get(keys[1]) == make_payload(1)
        assert reopened.keys() == [keys[0], keys[2], keys[1]]  # a hit is most recent
    finally:
        reopened.close()


@pytest.mark.parametrize(
    "other",
    [
        {"model_identity": "other-model"},
        {"block_size": 8},
        # The same model's cache stored another way (e.g. its CacheList layers, newly
        # cached): the old files are not read as the new layout.
        {"layer_layout": ("kv", "list[arrays:2,kv]")},
    ],
)
def test_restart_removes_incompatible_files(tmp_path: Path, other: dict) -> None:
    fill(tmp_path, 2)
    reopened = open_store(tmp_path, **other)
    try:
        assert reopened.keys() == []
        assert block_files(tmp_path) == []
    finally:
        reopened.close()


def test_restart_removes_truncated_garbage_and_temp_files(tmp_path: Path) -> None:
    keys = fill(tmp_path, 2)
    truncated = tmp_path / f"{keys[0]}.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-10])
    garbage = tmp_path / "00000000deadbeef.safetensors"
    garbage.write_bytes(b"\xff" * 100)
    temp = tmp_path / f"{keys[1]}.safetensors.123.tmp"
    temp.write_bytes(b"partial")
    reopened = open_store(tmp_path)
    try:
        assert reopened.keys() == [keys[1]]
        assert reopened.stats().corrupt_skipped == 2
        assert not truncated.exists() and not garbage.exists() and not temp.exists()
    finally:
        reopened.close()


def test_checksum_mismatch_is_never_served(store: SSDStore) -> None:
    payload = make_payload(1)
    store.put(payload)
    store.flush()
    (path,) = block_files(store.cache_dir)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # last byte of the data section
    path.write_bytes(bytes(raw))
    assert store.get(payload.key) is None
    assert store.stats().corrupt_skipped == 1
    assert not path.exists() and not store.contains(payload.key)


# -- seed 001 failure modes ----------------------------------------------------


def test_eviction_unlinks_inline_and_never_enqueues(tmp_path: Path) -> None:
    keys = fill(tmp_path, 10)
    store = open_store(tmp_path, max_size_bytes=3 * BLOCK_BYTES, queue_size=1)
    gate = Gate(store)
    try:
        assert store.put(make_payload(100))
        assert gate.entered.wait(5)
        # The new block is being written: its evictions already happened on this
        # thread, and nothing besides writes went on the (one-slot) queue.
        assert store.stats().pending_writes == 0
        assert store.stats().evictions == 8
        assert [p.name for p in block_files(tmp_path)] == [f"{k}.safetensors" for k in keys[8:]]
        gate.release()
        assert store.flush()
        assert store.keys() == [*keys[8:], make_payload(100).key]
    finally:
        gate.release()
        store.close()


def test_put_waits_for_room_before_dropping(tmp_path: Path) -> None:
    store = open_store(tmp_path / "q", queue_size=1)
    gate = Gate(store)
    try:
        assert store.put(make_payload(1))
        assert gate.entered.wait(5)  # the writer holds block 1
        assert store.put(make_payload(2))  # fills the queue
        start = time.monotonic()
        assert not store.put(make_payload(3))
        assert time.monotonic() - start >= 0.2
        assert (store.stats().drops, store.stats().saves) == (1, 2)

        # Room that appears within the timeout is waited for, not dropped.
        threading.Timer(0.05, gate.release).start()
        assert store.put(make_payload(4))
        assert store.flush()
        assert store.stats().drops == 1
        assert store.stats().saves_persisted == 3
    finally:
        gate.release()
        store.close()


def test_enospc_invalidates_disk_snapshot_and_writer_survives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reads: list[int] = []

    def free_bytes(_: Path) -> int:
        reads.append(1)
        return 1 << 30

    store = open_store(tmp_path, max_size_bytes="auto", free_bytes_fn=free_bytes)
    write = store._write_file
    try:
        for i in range(2):
            store.put(make_payload(i))
            store.flush()
        assert len(reads) == 1  # cached for disk_usage_ttl_s

        def disk_full(path: Path, header: bytes, chunks: list[bytes]) -> None:
            path.write_bytes(header)  # a partial temp file to clean up
            raise OSError(errno.ENOSPC, "No space left on device")

        store._write_file = disk_full  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="omlx.cache.ssd"):
            store.put(make_payload(2))
            store.flush()
        assert store.stats().errors == 1
        assert any("disk full" in r.message for r in caplog.records)
        assert list(tmp_path.glob("*.tmp")) == []

        store._write_file = write  # type: ignore[method-assign]
        store.put(make_payload(3))
        assert store.flush()
        assert len(reads) == 2  # the save after ENOSPC re-read free space
        assert store.contains(make_payload(3).key)
        assert store.stats().saves_persisted == 3
    finally:
        store.close()


def test_other_os_errors_are_counted_and_do_not_kill_the_writer(store: SSDStore) -> None:
    write = store._write_file

    def broken(path: Path, header: bytes, chunks: list[bytes]) -> None:
        raise OSError(errno.EIO, "I/O error")

    store._write_file = broken  # type: ignore[method-assign]
    store.put(make_payload(1))
    store.flush()
    store._write_file = write  # type: ignore[method-assign]
    store.put(make_payload(2))
    assert store.flush()
    assert store.stats().errors == 1
    assert store.keys() == [make_payload(2).key]


def test_saves_persisted_moves_only_after_rename(store: SSDStore) -> None:
    gate = Gate(store)
    payload = make_payload(5)
    try:
        assert store.put(payload)
        assert gate.entered.wait(5)  # temp file written and fsynced, not renamed
        stats = store.stats()
        assert (stats.saves, stats.saves_persisted) == (1, 0)
        assert block_files(store.cache_dir) == [] and not store.contains(payload.key)
        gate.release()
        assert store.flush()
        assert store.stats().saves_persisted == 1
        assert len(block_files(store.cache_dir)) == 1
    finally:
        gate.release()


def test_eviction_burst_is_capped_per_save_and_converges(tmp_path: Path) -> None:
    fill(tmp_path, 80)
    store = open_store(tmp_path, max_size_bytes=2 * BLOCK_BYTES)
    try:
        # 80 over budget: 32 go per save until one old block plus the new one fit.
        expected_files = [80 - 32 + 1, 80 - 64 + 2, 2, 2]
        for i, num_files in enumerate(expected_files):
            store.put(make_payload(100 + i))
            assert store.flush()
            assert len(block_files(tmp_path)) == num_files
        assert store.stats().evictions == 32 + 32 + 17 + 1
        assert store.stats().total_bytes <= 2 * BLOCK_BYTES
    finally:
        store.close()


# -- lifecycle -------------------------------------------------------------------


def test_close_flushes_pending_writes_within_the_bound(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    for i in range(20):
        assert store.put(make_payload(i))
    start = time.monotonic()
    assert store.close(timeout_s=5.0)
    assert time.monotonic() - start < 5.0
    assert len(block_files(tmp_path)) == 20
    assert not store.put(make_payload(99))


def test_close_gives_up_after_the_timeout(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    gate = Gate(store)
    store.put(make_payload(1))
    store.put(make_payload(2))
    start = time.monotonic()
    assert not store.close(timeout_s=0.2)
    assert time.monotonic() - start < 1.5  # 0.2 s flush + the writer-join grace
    gate.release()


def test_clear_leaves_no_file_from_an_in_flight_or_queued_write(store: SSDStore) -> None:
    store.put(make_payload(1))
    store.flush()
    gate = Gate(store)
    store.put(make_payload(2))
    assert gate.entered.wait(5)
    store.put(make_payload(3))  # queued behind the gated write
    threading.Timer(0.05, gate.release).start()
    store.clear()
    assert store.keys() == [] and block_files(store.cache_dir) == []
    assert store.stats().discarded == 1
    assert store.flush()
    assert block_files(store.cache_dir) == []
    store.put(make_payload(4))  # the store keeps working after clear()
    assert store.flush() and store.keys() == [make_payload(4).key]


def test_put_rejects_a_payload_for_another_store(store: SSDStore) -> None:
    with pytest.raises(ValueError):
        store.put(make_payload(1, model="other"))
    bad_key = BlockPayload("../etc", MODEL, 4, BLOCK_SIZE, LAYOUT, {})
    with pytest.raises(ValueError):
        store.put(bad_key)


def test_safetensors_io_rejects_inconsistent_tensor_bytes() -> None:
    with pytest.raises(ValueError):
        safetensors_io.encode({"x": ("F32", (2,), b"\x00" * 4)}, {})


def test_safetensors_header_with_null_metadata_reads_as_empty(tmp_path: Path) -> None:
    """mx.save_safetensors writes ``"__metadata__": null`` (model weights files)."""
    header = json.dumps(
        {"__metadata__": None, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    )
    raw = struct.pack("<Q", len(header)) + header.encode() + b"\x00" * 4
    path = tmp_path / "w.safetensors"
    path.write_bytes(raw)
    with path.open("rb") as f:
        entries, metadata, _ = safetensors_io.read_header(f, len(raw))
    assert metadata == {} and "x" in entries
    bad = raw.replace(b"null", b"[1] ")
    path.write_bytes(bad)
    with path.open("rb") as f, pytest.raises(ValueError, match="__metadata__"):
        safetensors_io.read_header(f, len(bad))


def test_a_block_too_large_for_the_budget_evicts_nothing(tmp_path: Path) -> None:
    """The budget was lowered below one block while four were on disk: the refused
    block must not take them with it (up to 32 used to be evicted first)."""
    keys = fill(tmp_path, 4)
    store = open_store(tmp_path, max_size_bytes=BLOCK_BYTES // 2)
    try:
        huge = make_payload(50)  # a block's bytes: more than the whole budget
        assert store.put(huge)
        assert store.flush()
        assert store.keys() == keys and store.stats().evictions == 0
        assert not store.contains(huge.key) and store.stats().errors == 1
    finally:
        store.close()


def test_a_fixed_size_shrinks_to_what_the_disk_has_until_space_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ssd_cache_max_size is fixed at 1 GiB, the disk fills up (ENOSPC): the cache turns
    over within what it holds instead of failing every write; space back, budget back."""
    free = {"bytes": 1 << 30}
    store = open_store(
        tmp_path,
        max_size_bytes=1 << 30,
        disk_usage_ttl_s=0.0,
        free_bytes_fn=lambda _: free["bytes"],
    )
    try:
        for i in range(3):
            assert store.put(make_payload(i))
        assert store.flush() and len(store.keys()) == 3
        free["bytes"] = 0  # what the disk-full error would find on the re-read
        with caplog.at_level(logging.WARNING, logger="omlx.cache.ssd"):
            assert store.put(make_payload(3))
            assert store.flush()
        assert store.keys() == [make_payload(k).key for k in (1, 2, 3)]  # the oldest made room
        assert store.stats().evictions == 1 and store.stats().errors == 0
        assert any("below ssd_cache_max_size" in r.message for r in caplog.records)
        free["bytes"] = 1 << 30
        assert store.put(make_payload(4)) and store.flush()
        assert len(store.keys()) == 4 and store.stats().evictions == 1
        assert any("disk space returned" in r.message for r in caplog.records)
    finally:
        store.close()


def test_clearing_a_full_disks_cache_gives_the_budget_back_at_once(tmp_path: Path) -> None:
    """The disk filled up (free space read as 0), then the cache was cleared: the next
    save must see the room the clear made, not the stale full-disk reading."""
    free = {"bytes": 0}
    store = open_store(tmp_path, max_size_bytes=1 << 30, free_bytes_fn=lambda _: free["bytes"])
    try:
        assert store.put(make_payload(0)) and store.flush()  # budget: what it holds
        assert not store.contains(make_payload(0).key)  # nothing held, nothing free
        free["bytes"] = 1 << 30  # the clear frees the disk (here: says so)
        store.clear()
        assert store.put(make_payload(1)) and store.flush()
        assert store.contains(make_payload(1).key)
    finally:
        store.close()
