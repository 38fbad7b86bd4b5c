"""A model's weights identified by their content (issue 41, defect 4).

The prefix cache keys a model's KV blocks by what decides their values. Names and
sizes are not enough: another fine-tune of the same base, or a re-download of a
fixed revision, has the same files of the same sizes and different numbers, and
blocks cached for the old weights would be served for the new ones.

Each weight file's content is hashed once (BLAKE2b over every byte; files are
hashed side by side, and hashlib releases the GIL while it reads) and the result
is kept in ``store`` keyed by the file's size, modification time and inode: a
later start reuses it, and a file replaced in any way (a new inode, a new mtime
or size) is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omlx.settings import write_json_atomic
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
_READ_BYTES = 8 * 1024**2
_MAX_THREADS = 4


def weight_files(path: Path) -> list[Path]:
    """The model folder's weight files, in name order."""
    return sorted(f for f in path.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def weights_digest(path: Path, store: Path | None) -> str:
    """A digest of every weight file's name and content in the folder ``path``;
    ``store``: where file hashes are kept between starts (None: not kept)."""
    files = weight_files(path)
    with ThreadPoolExecutor(max_workers=min(_MAX_THREADS, max(1, len(files)))) as pool:
        hashes = list(pool.map(lambda f: file_hash(f, store), files))
    digest = hashlib.blake2b(digest_size=16)
    for file, content in zip(files, hashes, strict=True):
        digest.update(json.dumps([file.name, content]).encode())
    return digest.hexdigest()


def file_hash(file: Path, store: Path | None) -> str:
    """The content hash of ``file``, from ``store`` when the file is unchanged since."""
    stat = file.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    kept = _kept_path(store, file)
    if kept is not None:
        entry = _read(kept)
        if entry is not None and entry.get("key") == key and isinstance(entry.get("hash"), str):
            return str(entry["hash"])
    started = time.perf_counter()
    content = _hash_content(file)
    log.info(
        "weights digest: hashed %s (%s) in %.1f s",
        file.name,
        format_bytes(stat.st_size),
        time.perf_counter() - started,
    )
    if kept is not None:
        try:
            write_json_atomic(kept, {"file": str(file), "key": key, "hash": content})
        except OSError as exc:  # a read-only data folder costs the next start a hash
            log.warning("weights digest: cannot keep the hash of %s: %s", file, exc)
    return content


def _hash_content(file: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(file, "rb") as f:
        while block := f.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _kept_path(store: Path | None, file: Path) -> Path | None:
    if store is None:
        return None
    name = hashlib.sha256(os.fsencode(file.resolve())).hexdigest()[:32]
    return store / f"{name}.json"


def _read(path: Path) -> dict[str, Any] | None:
    """The kept entry, or None when there is none or it cannot be read (hash again)."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None
