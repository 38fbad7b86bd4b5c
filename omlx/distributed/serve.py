"""``omlx serve --distributed MODEL`` under ``mlx.launch``: every rank joins the group;
rank 0 goes on to serve HTTP with a Cluster; the others follow it here and exit
when it does."""

from __future__ import annotations

import logging
import sys
from typing import Any

from omlx.distributed.cluster import Cluster, follower_memory
from omlx.distributed.group import Membership, join, open_control
from omlx.distributed.loading import load_shard
from omlx.distributed.replica import follow
from omlx.errors import ModelNotFoundError
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

    from omlx.engine.runner import BatchRunner
    from omlx.engine.strategy import ExecutionStrategy
    from omlx.memory.guard import memory_limits
    from omlx.memory.probe import MemoryProbe, total_ram_bytes
    from omlx.models.discovery import discover_models

    stream = mx.new_stream(mx.default_device())
    probe = MemoryProbe(settings.memory.poll_interval_s)
    hard_bytes = memory_limits(settings.memory, total_ram_bytes()).hard_bytes

    def load(name: str) -> BatchRunner:
        info = discover_models(settings.model_dirs).get(name)
        if info is None:
            raise ModelNotFoundError(
                f"rank {member.rank} has no model '{name}' in "
                f"{', '.join(map(str, settings.model_dirs))}: copy it there on this host"
            )
        loaded = load_shard(info, member, mode)
        return BatchRunner(
            loaded.model,
            prefill_step_size=settings.scheduler.prefill_step_size,
            stream=stream,
            # The same strategy as rank 0's (assembly.py), so both run the same calls.
            strategy=ExecutionStrategy.choose(
                settings.scheduler.execution_strategy, mx.default_device().type.name
            ).split(),
        )

    log.info("distributed: rank %d of %d follows rank 0", member.rank, member.size)
    with mx.stream(stream):
        return follow(sock, load, lambda: follower_memory(probe, hard_bytes))


def _follower_logging(settings: Settings, rank: int) -> None:
    """Followers log to stderr only (mlx.launch prefixes nothing; the rank does)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, settings.server.log_level.upper()))
