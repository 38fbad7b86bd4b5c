"""The SSD tier of the prefix cache: one safetensors file per KV block.

Bytes in, bytes out: the MLX thread turns arrays into bytes before calling
``SSDStore.put`` and back after ``SSDStore.get``, so this module never imports
mlx. A single writer thread drains a bounded queue; eviction unlinks files
inline on that thread and never puts work on the queue (a queue that carried
both writes and unlinks could only fill up, never drain, once saturated).

The store's folder carries a marker file written when omlx claims it; a folder
with other files and no marker is refused. Inside its folder the store reads and
deletes only files named exactly as it names them (hex key + ``.safetensors``,
and its temp files): anything else there is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from omlx.cache import safetensors_io
from omlx.cache.safetensors_io import BlockPayload, BlockSpec, SafetensorsFormatError
from omlx.errors import SettingsError
from omlx.private_fs import FILE_MODE, make_private_dir

__all__ = ["BlockPayload", "SSDStore", "SSDStoreStats"]

logger = logging.getLogger(__name__)

BLOCK_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
_KEY_RE = re.compile(r"[0-9a-f]{8,128}")
# The only names the store ever opens or deletes.
_BLOCK_NAME_RE = re.compile(r"([0-9a-f]{8,128})\.safetensors")
_TEMP_NAME_RE = re.compile(r"[0-9a-f]{8,128}\.safetensors\.[0-9]+\.tmp")
MARKER_NAME = "OMLX_CACHE"
MARKER = {"format": "omlx-kv", "version": 1}

# How long a put waits for room in the write queue before dropping the block.
PUT_TIMEOUT_S = 0.25


@dataclass(frozen=True, slots=True)
class SSDStoreStats:
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    evictions: int = 0
    errors: int = 0
    drops: int = 0
    saves: int = 0
    saves_persisted: int = 0
    corrupt_skipped: int = 0
    discarded: int = 0
    num_blocks: int = 0
    total_bytes: int = 0
    pending_writes: int = 0


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    evictions: int = 0
    errors: int = 0
    drops: int = 0
    saves: int = 0
    saves_persisted: int = 0
    corrupt_skipped: int = 0
    discarded: int = 0


@dataclass(slots=True)
class _Entry:
    size_bytes: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class _WriteItem:
    payload: BlockPayload
    generation: int


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class SSDStore:
    """An LRU, size-bounded directory of KV blocks, written by one background thread.

    ``cache_dir`` belongs to one (model identity, layer layout, block size):
    block files written for anything else are removed when the store opens;
    files the store did not name are left alone. Raises ``SettingsError`` for a
    folder with other files and no omlx marker.
    ``max_size_bytes="auto"`` budgets ``auto_fraction`` of the space the cache
    could use (free bytes plus what it already holds), re-reading free space
    at most every ``disk_usage_ttl_s`` (and after a disk-full error). A fixed size
    is never more than that space either. ``free_bytes_fn`` exists for tests.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        *,
        model_identity: str,
        layer_layout: tuple[str, ...],
        block_size: int,
        max_size_bytes: int | Literal["auto"],
        auto_fraction: float = 0.1,
        queue_size: int = 64,
        put_timeout_s: float = PUT_TIMEOUT_S,
        max_inline_unlinks: int = 32,
        disk_usage_ttl_s: float = 30.0,
        free_bytes_fn: Callable[[Path], int] = _free_bytes,
    ):
        if max_size_bytes != "auto" and (
            not isinstance(max_size_bytes, int) or max_size_bytes <= 0
        ):
            raise ValueError(
                f"max_size_bytes must be a positive int or 'auto', got {max_size_bytes!r}"
            )
        self.cache_dir = Path(cache_dir)
        _claim_folder(self.cache_dir)
        self.spec = BlockSpec(model_identity, tuple(layer_layout), block_size)
        self._max_size_bytes = max_size_bytes
        self._auto_fraction = auto_fraction
        self._put_timeout_s = put_timeout_s
        self._max_inline_unlinks = max_inline_unlinks
        self._disk_usage_ttl_s = disk_usage_ttl_s
        self._free_bytes_fn = free_bytes_fn

        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self._total_bytes = 0
        self._counters = _Counters()
        self._free_bytes_snapshot: int | None = None  # None: re-read on the next save
        self._free_bytes_read_at_s = 0.0
        self._disk_bound = False  # a fixed size the disk's free space holds below
        self._num_unfinished = 0  # accepted puts the writer has not finished
        self._generation = 0  # bumped by clear(); older queued writes are void
        self._closed = False
        self._stop = threading.Event()
        # None: close()'s wake-up, so the writer stops now rather than at its next poll.
        self._queue: queue.Queue[_WriteItem | None] = queue.Queue(queue_size)

        self._rebuild_index()
        self._writer = threading.Thread(
            target=self._run_writer, name="ssd-cache-writer", daemon=True
        )
        self._writer.start()

    # -- public API -------------------------------------------------------

    def put(self, payload: BlockPayload, *, deadline_s: float | None = None) -> bool:
        """Queue ``payload`` for writing. Returns True if accepted, False if dropped.

        Waits at most ``put_timeout_s`` for room in the write queue (and never past
        ``deadline_s``, a ``time.monotonic()`` instant several puts of one caller
        share, so a burst stalls its thread once, not once per block), so a short
        writer backlog does not drop blocks; only sustained saturation (or a
        closed store) drops, counted in ``drops``. An accepted put counts in
        ``saves`` at once; ``saves_persisted`` moves after the file's atomic
        rename. A key already on disk is not rewritten (returns True, touches LRU).
        Raises ValueError for a payload this store cannot hold.
        """
        if not _KEY_RE.fullmatch(payload.key):
            raise ValueError(f"block key must be 8-128 lowercase hex digits, got {payload.key!r}")
        self.spec.check_payload(payload)
        with self._lock:
            if self._closed:
                self._counters.drops += 1
                return False
            if payload.key in self._index:
                self._index.move_to_end(payload.key)
                return True
            # Count before the put so saves >= saves_persisted holds at every instant.
            self._counters.saves += 1
            self._num_unfinished += 1
            item = _WriteItem(payload, self._generation)
        try:
            timeout = self._put_timeout_s
            if deadline_s is not None:
                timeout = min(timeout, max(0.0, deadline_s - time.monotonic()))
            self._queue.put(item, timeout=timeout)
        except queue.Full:
            with self._lock:
                self._counters.saves -= 1
                self._counters.drops += 1
                self._finish_one_locked()
            return False
        return True

    def get(self, key: str) -> BlockPayload | None:
        """Read a block, or None. A file that fails its checksum or header is never served:
        it is counted in ``corrupt_skipped``, deleted and dropped from the index."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._counters.misses += 1
                return None
        path = self._path(key)
        try:
            payload = self._read_block(path, key)
            os.utime(path)  # mtime is the LRU order after a restart
        except FileNotFoundError:  # evicted or cleared meanwhile
            payload = None
        except (OSError, SafetensorsFormatError, ValueError) as e:
            logger.warning("SSD cache: skipping unreadable block %s: %s", key, e)
            path.unlink(missing_ok=True)
            payload = None
            with self._lock:
                self._counters.corrupt_skipped += 1
        with self._lock:
            if payload is None:
                self._counters.misses += 1
                self._drop_entry_locked(key)
                return None
            self._counters.hits += 1
            self._counters.tokens_saved += payload.num_tokens
            if key in self._index:
                self._index.move_to_end(key)
        return payload

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[str]:
        """Persisted keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every accepted put is finished (written, failed or discarded)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._num_unfinished > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def clear(self, timeout_s: float = 5.0) -> None:
        """Remove every block. Queued writes are discarded (counted in ``discarded``).

        Waits up to ``timeout_s`` for a write already in progress; that write
        sees the bumped generation and deletes its own file, so no block
        written before clear() survives it.
        """
        with self._lock:
            self._generation += 1
            self._index.clear()
            self._total_bytes = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # close()'s wake-up, not a write (the writer still stops)
                continue
            with self._lock:
                self._counters.discarded += 1
                self._finish_one_locked()
        self.flush(timeout_s)
        for path in _own_files(self.cache_dir):
            path.unlink(missing_ok=True)
        with self._lock:
            # The disk has the freed room now: the next save reads it, not a full disk.
            self._free_bytes_snapshot = None

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop accepting puts, write what is queued within ``timeout_s``, stop the writer.

        Returns True if every queued write finished in time; writes still
        queued after the deadline are discarded.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._closed = True
        flushed = self.flush(timeout_s)
        self._stop.set()
        with contextlib.suppress(queue.Full):  # full: the writer is awake and sees the stop
            self._queue.put_nowait(None)
        self._writer.join(max(0.0, deadline - time.monotonic()) + 0.5)
        return flushed

    def stats(self) -> SSDStoreStats:
        with self._lock:
            counts = {f.name: getattr(self._counters, f.name) for f in fields(_Counters)}
            return SSDStoreStats(
                **counts,
                num_blocks=len(self._index),
                total_bytes=self._total_bytes,
                pending_writes=self._queue.qsize(),
            )

    # -- writer thread ----------------------------------------------------

    def _run_writer(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                item = None
            if item is None:
                if self._stop.is_set():
                    return
                continue
            try:
                if self._stop.is_set():
                    with self._lock:
                        self._counters.discarded += 1
                else:
                    self._save(item)
            except Exception:  # the writer must outlive any one bad block
                logger.exception("SSD cache: unexpected error saving a block")
                with self._lock:
                    self._counters.errors += 1
            finally:
                with self._lock:
                    self._finish_one_locked()

    def _save(self, item: _WriteItem) -> None:
        payload = item.payload
        header, chunks = safetensors_io.encode_block(payload)
        size_bytes = len(header) + sum(len(c) for c in chunks)
        if not self._make_room(size_bytes):
            return
        path = self._path(payload.key)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}{TEMP_SUFFIX}")
        try:
            self._write_file(tmp, header, chunks)
            with self._lock:
                stale = item.generation != self._generation
            if stale:
                tmp.unlink(missing_ok=True)
                return
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._on_write_error(payload.key, e)
            return
        with self._lock:
            stale = item.generation != self._generation
            if not stale:
                self._drop_entry_locked(payload.key)
                self._index[payload.key] = _Entry(size_bytes, payload.num_tokens)
                self._total_bytes += size_bytes
                self._counters.saves_persisted += 1
        if stale:  # clear() ran between the rename and here
            path.unlink(missing_ok=True)

    def _write_file(self, path: Path, header: bytes, chunks: list[bytes]) -> None:
        """Write and fsync one temp file. The test seam for injecting I/O failures.
        O_EXCL: never write through a file (or symlink) that is already there."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

    def _on_write_error(self, key: str, e: OSError) -> None:
        with self._lock:
            self._counters.errors += 1
            if e.errno == errno.ENOSPC:
                # Under the lock, so no save pairs a fresh value with a stale timestamp.
                self._free_bytes_snapshot = None
        if e.errno == errno.ENOSPC:
            logger.error(
                "SSD cache: disk full writing block %s; block lost. Free space is re-read "
                "on the next save, but writes already queued may fail the same way.",
                key,
            )
        else:
            logger.error("SSD cache: failed to write block %s: %s", key, e)

    def _make_room(self, size_bytes: int) -> bool:
        """Evict LRU blocks inline, at most ``max_inline_unlinks`` per save; the rest
        of an over-budget backlog is left for later saves. False if the block can never fit."""
        with self._lock:
            budget = self._budget_bytes_locked()
            # Checked first: a block that can never fit must not cost good ones.
            too_large = size_bytes > budget
            victims: list[str] = []
            while (
                not too_large
                and self._index
                and self._total_bytes + size_bytes > budget
                and len(victims) < self._max_inline_unlinks
            ):
                key, entry = self._index.popitem(last=False)
                self._total_bytes -= entry.size_bytes
                victims.append(key)
            self._counters.evictions += len(victims)
            if too_large:
                self._counters.errors += 1
        for key in victims:
            self._path(key).unlink(missing_ok=True)
        if too_large:
            logger.warning(
                "SSD cache: a %d-byte block exceeds the %d-byte budget", size_bytes, budget
            )
        return not too_large

    def _budget_bytes_locked(self) -> int:
        """ "auto": a fraction of what the disk could give. A fixed size: itself, but
        never more than the disk has (what is held plus what is free): after a disk-
        full error the cache turns over within what it holds until space returns."""
        now = time.monotonic()
        if (
            self._free_bytes_snapshot is None
            or now - self._free_bytes_read_at_s > self._disk_usage_ttl_s
        ):
            self._free_bytes_snapshot = self._free_bytes_fn(self.cache_dir)
            self._free_bytes_read_at_s = now
        disk_bytes = self._free_bytes_snapshot + self._total_bytes
        if self._max_size_bytes == "auto":
            return int(self._auto_fraction * disk_bytes)
        shrunk = disk_bytes < self._max_size_bytes
        if shrunk != self._disk_bound:
            self._disk_bound = shrunk
            if shrunk:
                logger.warning(
                    "SSD cache: the disk has room for %d bytes of cache (held + free), "
                    "below ssd_cache_max_size: that is the budget until space returns",
                    disk_bytes,
                )
            else:
                logger.warning(
                    "SSD cache: disk space returned: budget %d bytes again", self._max_size_bytes
                )
        return min(self._max_size_bytes, disk_bytes)

    def _finish_one_locked(self) -> None:
        self._num_unfinished -= 1
        if self._num_unfinished == 0:
            self._idle.notify_all()

    # -- files ------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.cache_dir / f"{key}{BLOCK_SUFFIX}"

    def _drop_entry_locked(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._total_bytes -= entry.size_bytes

    def _read_block(self, path: Path, key: str) -> BlockPayload:
        with open(path, "rb") as f:
            return safetensors_io.read_block(f, os.fstat(f.fileno()).st_size, key, self.spec)

    def _rebuild_index(self) -> None:
        """Index the block files already in cache_dir from their headers, oldest mtime
        first. Removes temp files from a crash and block files that are corrupt or
        belong to another model identity; files named otherwise are never opened."""
        found: list[tuple[float, str, _Entry]] = []
        for path in _own_files(self.cache_dir):
            block = _BLOCK_NAME_RE.fullmatch(path.name)
            if block is None:
                path.unlink(missing_ok=True)  # a temp file from a crash
            else:
                key = block.group(1)
                try:
                    stat = path.stat()
                    with open(path, "rb") as f:
                        num_tokens = safetensors_io.read_block_tokens(
                            f, stat.st_size, key, self.spec
                        )
                except (OSError, ValueError) as e:  # SafetensorsFormatError is a ValueError
                    logger.info("SSD cache: removing %s: %s", path.name, e)
                    if isinstance(e, SafetensorsFormatError):
                        self._counters.corrupt_skipped += 1
                    path.unlink(missing_ok=True)
                    continue
                found.append((stat.st_mtime, key, _Entry(stat.st_size, num_tokens)))
        for _, key, entry in sorted(found):
            self._index[key] = entry
            self._total_bytes += entry.size_bytes


# -- the store's folder -------------------------------------------------------


def _own_files(folder: Path) -> list[Path]:
    """Regular files in ``folder`` named as the store names its blocks and temp files."""
    with os.scandir(folder) as entries:
        return [
            Path(entry.path)
            for entry in entries
            if (_BLOCK_NAME_RE.fullmatch(entry.name) or _TEMP_NAME_RE.fullmatch(entry.name))
            and entry.is_file(follow_symlinks=False)
        ]


def _read_marker(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "unreadable"


def _claim_folder(folder: Path) -> None:
    """Create ``folder`` (0700) and mark it as omlx's, or accept it when already marked.

    A folder holding other files and no marker is someone else's: refused, so the
    store never deletes there. A marker left half-written cannot happen (it is
    renamed into place); leftovers of that rename are ignored.
    """
    make_private_dir(folder)
    marker = folder / MARKER_NAME
    found = _read_marker(marker)
    if found == MARKER:
        return
    others = sorted(p.name for p in folder.iterdir() if not p.name.startswith(f".{MARKER_NAME}."))
    if found is not None or others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise SettingsError(
            f"{folder} is not an omlx cache folder (no valid {MARKER_NAME} marker; it holds "
            f"{shown}): omlx will not write or delete there. Empty it or choose another "
            "cache.ssd_cache_dir.",
            param="cache.ssd_cache_dir",
        )
    fd, tmp = tempfile.mkstemp(prefix=f".{MARKER_NAME}.", dir=folder)  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(MARKER, f)
        os.replace(tmp, marker)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
