"""The prefix cache of a model split across ranks: every rank keeps its own KV shard in
its own tiers (its own SSD folder), under the same block keys. Their tiers evict on
their own, so at each lookup the ranks gather what each restored (one small MLX
collective) and every rank keeps the longest hit all of them hold
(``prefix_index.common_hit``): all restore the same tokens.

The collective runs on the CPU stream, as the group's first ones do (group.py), once
the runner's stream has finished what it queued: a forward in flight (pipelined
decode) meets its own collectives first on every rank, so no two ranks pair
different ones."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omlx.cache.prefix_index import HitSpan, common_hit
from omlx.distributed.group import Membership

if TYPE_CHECKING:
    from omlx.cache.prefix import AgreeHits


def shard_name(member: Membership, parallel: str) -> str:
    """This rank's part of the model, e.g. "tensor-rank1-of-2" (its SSD folder's suffix)."""
    return f"{parallel}-rank{member.rank}-of-{member.size}"


def agree_hits(member: Membership) -> AgreeHits:
    """Every rank's spans of the same prompts in, the length all of them hold out."""
    return lambda spans: [common_hit(every) for every in _gather(member, spans)]


def _gather(member: Membership, spans: list[HitSpan]) -> list[list[HitSpan]]:
    """Per span (one per prompt, the same prompts on every rank), every rank's span."""
    import mlx.core as mx

    rows = mx.array([[s.step, s.whole, s.total] for s in spans], dtype=mx.int32)
    mx.synchronize()  # the runner's stream (the MLX thread's default)
    every = mx.distributed.all_gather(rows, group=member.group, stream=mx.cpu)
    values: list[Any] = every.tolist()
    count = len(spans)
    return [
        [HitSpan(*values[rank * count + i]) for rank in range(member.size)] for i in range(count)
    ]
