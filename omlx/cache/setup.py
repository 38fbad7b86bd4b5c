"""Building the prefix cache from settings: the shared RAM tier and, per loaded
model, its SSD store and PrefixCache."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Literal

from omlx.cache.hot import HotTier
from omlx.cache.kv_codec import layer_layout, unstorable
from omlx.cache.location import check_cache_location, model_cache_dir, report_old_layout
from omlx.cache.prefix import PrefixCache, model_identity
from omlx.cache.ssd import SSDStore
from omlx.errors import SettingsError
from omlx.mlx_types import prompt_cache
from omlx.models.loader import LoadedModel
from omlx.private_fs import make_private_dir
from omlx.settings import Settings
from omlx.sizes import format_bytes, parse_byte_size

log = logging.getLogger(__name__)


def make_hot_tier(settings: Settings, ram_bytes: int) -> HotTier | None:
    """The RAM tier, after refusing (``SettingsError``) a cache folder that overlaps
    a model folder; called once as the engine pool starts."""
    cfg = settings.cache
    if not cfg.enabled:
        log.info("prefix cache disabled (cache.enabled=false)")
        return None
    if cfg.hot_cache_mode != "hot-only":
        check_cache_location(settings)
        report_old_layout(settings)
    budget = parse_byte_size(
        cfg.hot_cache_max_size, total_bytes=ram_bytes, field="cache.hot_cache_max_size"
    )
    log.info(
        "prefix cache: RAM tier %s (%s), SSD tier %s",
        format_bytes(budget),
        cfg.hot_cache_mode,
        "off" if cfg.hot_cache_mode == "hot-only" else settings.cache_dir,
    )
    return HotTier(budget, mode=cfg.hot_cache_mode)


def ssd_budget(value: str | int, directory: Path) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    make_private_dir(directory)
    total = shutil.disk_usage(directory).total
    return parse_byte_size(value, total_bytes=total, field="cache.ssd_cache_max_size")


def make_prefix_cache(
    settings: Settings, hot: HotTier | None, loaded: LoadedModel, shard: str = ""
) -> PrefixCache | None:
    """MLX thread. None when the cache is off or the model's layers cannot be cached.
    ``shard``: a rank's part of a split model, e.g. "tensor-rank1-of-2" (its SSD
    folder's suffix: ranks on one host share no file)."""
    cfg = settings.cache
    if hot is None:
        return None
    name = loaded.info.name
    family = loaded.vision.family if loaded.vision is not None else None
    if family is not None and family.no_prefix_cache:
        log.warning("prefix cache off for %s: %s", name, family.no_prefix_cache)
        return None
    layers = prompt_cache(loaded.model)
    layout = layer_layout(layers)
    if layout is None:
        log.warning(
            "prefix cache off for %s: its cache types %s cannot be stored (omlx saves and "
            "rebuilds mlx-lm's KVCache, QuantizedKVCache, RotatingKVCache, ChunkedKVCache, "
            "ArraysCache and CacheLists of them; another type's state has no known layout "
            "to cut into blocks and restore)",
            name,
            unstorable(layers),
        )
        return None
    identity = model_identity(name, loaded.info.path, settings.base_path / "weight-hashes")
    ssd = None
    if cfg.hot_cache_mode != "hot-only":
        ssd = open_ssd_store(settings, name, identity, layout, shard)
    prefix = PrefixCache(identity, layout, cfg.block_size, hot, ssd)
    log.info(
        "prefix cache for %s: %s, block %d tokens, %s%s",
        name,
        identity,
        cfg.block_size,
        "sliceable KV"
        if prefix.sliceable
        else "boundary snapshots (recurrent/window/chunked layers)",
        f", SSD {ssd.cache_dir} ({len(ssd.keys())} blocks)" if ssd else ", RAM only",
    )
    return prefix


def open_ssd_store(
    settings: Settings, name: str, identity: str, layout: tuple[str, ...], shard: str = ""
) -> SSDStore | None:
    """The model's SSD store; None (RAM only, with a warning) when its folder holds
    files omlx did not write, which the store refuses to touch, or cannot be used."""
    cfg = settings.cache
    directory = model_cache_dir(settings, name, shard)
    budget = ssd_budget(cfg.ssd_cache_max_size, directory)
    try:
        return SSDStore(
            directory,
            model_identity=identity,
            layer_layout=layout,
            block_size=cfg.block_size,
            max_size_bytes=budget,
            auto_fraction=cfg.ssd_auto_fraction,
        )
    except SettingsError as exc:
        log.warning("prefix cache for %s stays in RAM: %s", name, exc.message)
    except OSError as exc:  # e.g. a full or read-only disk while marking the folder
        log.warning("prefix cache for %s stays in RAM: cannot use %s: %s", name, directory, exc)
    return None
