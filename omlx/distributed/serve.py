"""``omlx serve --distributed MODEL`` under ``mlx.launch``: every rank joins the group;
rank 0 goes on to serve HTTP with a Cluster; the others follow it here and exit
when it does."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

from omlx.distributed.cluster import Cluster, follower_memory
from omlx.distributed.group import Membership, join, open_control
from omlx.distributed.loading import load_shard
from omlx.distributed.replica import follow
from omlx.distributed.shared_hits import agree_hits, shard_name
from omlx.errors import NotFoundError
from omlx.settings import Settings

log = logging.getLogger(__name__)


def distributed_role(settings: Settings, model: str, backend: str, mode: str) -> Cluster | int:
    """Rank 0: its Cluster (go on serving). Other ranks: their exit code, after
    following rank 0 until it stops."""
    member = join(backend)
    leader, sock = open_control(member)
    if leader is not None:
        log.info("distributed: rank 0 of %d (%s backend) serves %s", member.size, backend, model)
        return Cluster(member, leader, model, mode)
    assert sock is not None
    _follower_logging(settings, member.rank)
    return _follow(settings, member, sock, mode)


def _follow(settings: Settings, member: Membership, sock: Any, mode: str) -> int:
    import mlx.core as mx

    from omlx.cache.setup import make_hot_tier
    from omlx.memory.guard import memory_limits
    from omlx.memory.probe import MemoryProbe, total_ram_bytes

    stream = mx.new_stream(mx.default_device())
    probe = MemoryProbe(settings.memory.poll_interval_s)
    hard_bytes = memory_limits(settings.memory, total_ram_bytes()).hard_bytes
    # This rank's own prefix cache: its KV shard, in its RAM tier and SSD folder.
    hot = make_hot_tier(settings, total_ram_bytes())
    caches: list[Any] = []  # the loaded model's PrefixCache, closed at the next load or exit

    def load(name: str) -> Any:
        while caches:
            caches.pop().close()
        runner, prefix = _follower_runner(settings, member, mode, name, stream, hot)
        if prefix is not None:
            caches.append(prefix)
        return runner

    log.info("distributed: rank %d of %d follows rank 0", member.rank, member.size)
    try:
        with mx.stream(stream):
            return follow(sock, load, lambda: _facts(probe, hard_bytes, caches))
    finally:
        for prefix in caches:  # write-back: its RAM blocks go to its SSD folder
            prefix.close()


def _facts(probe: Any, hard_bytes: int, caches: list[Any]) -> dict[str, Any]:
    """What a follower sends with every reply (rank 0's /health shows them)."""
    cache = caches[0].stats() if caches else None
    return {"memory": follower_memory(probe, hard_bytes), "cache": cache}


def _follower_runner(
    settings: Settings, member: Membership, mode: str, name: str, stream: Any, hot: Any
) -> tuple[Any, Any]:
    """This rank's BatchRunner for model ``name`` and its PrefixCache (None: off)."""
    import mlx.core as mx

    from omlx.cache.setup import make_prefix_cache
    from omlx.engine.runner import BatchRunner
    from omlx.engine.strategy import ExecutionStrategy
    from omlx.models.discovery import discover_models
    from omlx.models.model_settings import ModelSettingsStore

    info = discover_models(settings.model_dirs).get(name)
    if info is None:
        # Not ModelNotFoundError, which lists the models served instead of this host's gap.
        raise NotFoundError(
            f"rank {member.rank} has no model '{name}' in "
            f"{', '.join(map(str, settings.model_dirs))}: copy it there on this host",
            param="model",
        )
    # Rank 0's catalog applies the model's settings; a follower reads the same file.
    own = ModelSettingsStore(settings.model_settings_path).get(name)
    loaded = load_shard(
        dataclasses.replace(info, trust_remote_code=own.trust_remote_code), member, mode
    )
    shard = shard_name(member, loaded.config["omlx_parallel"])
    prefix = make_prefix_cache(settings, hot, loaded, shard)
    runner = BatchRunner(
        loaded.model,
        prefill_step_size=settings.scheduler.prefill_step_size,
        stream=stream,
        prefix_cache=prefix,
        # The same strategy as rank 0's (assembly.py), so both run the same calls.
        strategy=ExecutionStrategy.choose(
            settings.scheduler.execution_strategy, mx.default_device().type.name
        ).split(),
        shared_hits=agree_hits(member),
    )
    return runner, prefix


def _follower_logging(settings: Settings, rank: int) -> None:
    """Followers log to stderr only (mlx.launch prefixes nothing; the rank does)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, settings.server.log_level.upper()))
