"""Where the SSD tier keeps its blocks, and the cache folders omlx refuses.

Blocks live in ``<cache.ssd_cache_dir>/omlx-kv-v1/<model folder>/`` (a rank of a model
split across ranks: ``<model folder>-<shard>/``, its own KV shard): omlx only
ever touches that subfolder, so the cache folder itself may hold other things.
A cache folder that overlaps a model folder is refused at start, before any
file is opened, so no setting can point the cache's deletes at model weights.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from omlx.errors import SettingsError
from omlx.settings import Settings

log = logging.getLogger(__name__)

SSD_ROOT_NAME = "omlx-kv-v1"
_SLUG_LEN = 48
# Block file names any omlx version wrote: hex key + ".safetensors".
_OLD_BLOCK_NAME = re.compile(r"[0-9a-f]{8,128}\.safetensors")


def ssd_root(settings: Settings) -> Path:
    return settings.cache_dir / SSD_ROOT_NAME


def model_folder_name(model_name: str) -> str:
    """A readable slug plus a digest of the exact name: ``a/b`` and ``a_b`` (and
    ``A`` and ``a``, on a case-insensitive disk) get different folders."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name).strip("._")[:_SLUG_LEN] or "model"
    digest = hashlib.blake2b(model_name.encode("utf-8"), digest_size=8).hexdigest()
    return f"{slug}-{digest}"


def model_cache_dir(settings: Settings, model_name: str, shard: str = "") -> Path:
    """``shard``: a rank's part of a split model (its blocks hold only its KV shard)."""
    folder = model_folder_name(model_name)
    return ssd_root(settings) / (f"{folder}-{shard}" if shard else folder)


def _within(inner: Path, outer: Path) -> bool:
    """Whether ``inner`` is ``outer`` or lies under it, symlinks followed. Existing
    folders are also compared by inode, which a case-insensitive disk (macOS) needs:
    there ``~/Models`` and ``~/models`` are one folder under two spellings."""
    inner, outer = inner.expanduser().resolve(), outer.expanduser().resolve()
    if inner.is_relative_to(outer):
        return True
    try:
        target = outer.stat()
    except OSError:
        return False
    for folder in (inner, *inner.parents):
        try:
            info = folder.stat()
        except OSError:
            continue
        if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def check_cache_location(settings: Settings) -> None:
    """Refuse a cache folder that is, holds or lies inside a model folder.

    Raises ``SettingsError`` naming ``cache.ssd_cache_dir`` and the model folder.
    """
    cache = settings.cache_dir
    for model_dir in settings.model_dirs:
        inside, contains = _within(cache, model_dir), _within(model_dir, cache)
        if inside and contains:
            relation = "is the model folder"
        elif inside:
            relation = "is inside the model folder"
        elif contains:
            relation = "contains the model folder"
        else:
            continue
        raise SettingsError(
            f"cache.ssd_cache_dir {settings.cache_dir} {relation} {model_dir}: the prefix "
            "cache must not share files with models. Choose a separate folder "
            "(--cache-dir, OMLX_CACHE__SSD_CACHE_DIR or settings.json).",
            param="cache.ssd_cache_dir",
        )


def report_old_layout(settings: Settings) -> None:
    """Log once where an older omlx left blocks (``<cache>/<model>/``). They are not
    read and not deleted: only the user knows the folder holds nothing else."""
    try:
        folders = [
            child
            for child in settings.cache_dir.iterdir()
            if child.is_dir() and child.name != SSD_ROOT_NAME and _holds_old_blocks(child)
        ]
    except OSError:
        return
    if folders:
        log.info(
            "prefix cache: %s hold(s) blocks from an older omlx layout, no longer used; "
            "delete them to free the space",
            ", ".join(str(f) for f in sorted(folders)),
        )


def _holds_old_blocks(folder: Path) -> bool:
    try:
        return any(_OLD_BLOCK_NAME.fullmatch(p.name) for p in folder.iterdir())
    except OSError:
        return False
