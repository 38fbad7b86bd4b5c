"""Weights identified by content (omlx/cache/weights_digest.py): each file hashed once
and kept by size, mtime and inode; any change to a file hashes it again."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from omlx.cache.weights_digest import weights_digest


def _model(folder: Path, content: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_bytes(content)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"second shard")
    return folder


def _hashed(caplog: pytest.LogCaptureFixture) -> int:
    return sum("weights digest: hashed" in m for m in caplog.messages)


def test_same_sizes_other_content_is_another_model(tmp_path: Path) -> None:
    a = _model(tmp_path / "a", b"\x01" * 4096)
    b = _model(tmp_path / "b", b"\x02" * 4096)
    c = _model(tmp_path / "c", b"\x01" * 4096)
    assert weights_digest(a, None) != weights_digest(b, None)
    assert weights_digest(a, None) == weights_digest(c, None)  # a copy is the same model


def test_a_file_is_hashed_once_and_again_only_when_it_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="omlx")
    model, store = _model(tmp_path / "m", b"\x01" * 4096), tmp_path / "hashes"
    first = weights_digest(model, store)
    assert _hashed(caplog) == 2
    assert weights_digest(model, store) == first and _hashed(caplog) == 2  # kept
    shard = model / "model-00001-of-00002.safetensors"
    # Replaced as a download replaces it (a new file: a new inode), of the same
    # size, its old mtime put back: hashed again.
    stat = shard.stat()
    replacement = tmp_path / "replacement"
    replacement.write_bytes(b"\x02" * 4096)
    os.replace(replacement, shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    swapped = weights_digest(model, store)
    assert swapped != first and _hashed(caplog) == 3
    # Touched only: hashed again, same content, same digest.
    os.utime(shard)
    assert weights_digest(model, store) == swapped and _hashed(caplog) == 4


def test_an_unreadable_kept_hash_is_recomputed(tmp_path: Path) -> None:
    model, store = _model(tmp_path / "m", b"\x01" * 4096), tmp_path / "hashes"
    first = weights_digest(model, store)
    for kept in store.iterdir():
        kept.write_text("not json")
    assert weights_digest(model, store) == first
