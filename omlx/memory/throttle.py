"""Throttle before the kill (issue 27, defect 5). Pure: no MLX.

When the forward gate says a step's prefill chunks would pass the hard limit,
ending a request is the last resort. First every chunk of the step is capped
(halving, down to ``MIN_PREFILL_CHUNK`` tokens): a smaller chunk allocates less
KV and a smaller attention transient. If not even the floor fits and requests
are decoding beside it, or other work goes on in the process (they end and free
their memory), the prefill waits a step: as many as it takes, since how long work
takes on a loaded machine is not a memory fact. Only then are the chunks that do
not fit ended (the scheduler first lets the newest request give way).

One cap for the whole step, not one per request: rows prefilled in one batched
forward are right-padded to the longest, so only a cap on all of them shrinks
that forward. An indivisible chunk (a whole-prompt image prompt, whose tokens
attend as one forward) is never capped: it runs whole, waits, or is ended.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "MIN_PREFILL_CHUNK",
    "PlannedChunk",
    "PrefillShape",
    "shape_prefill",
]

# Below this a chunk costs more in per-forward overhead than it saves in memory.
MIN_PREFILL_CHUNK = 32

# (tokens this step runs up to and including the chunk, the chunk's cached
# tokens) -> does the chunk fit under the hard limit?
ChunkFits = Callable[[int, int], bool]


class PlannedChunk(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_context_tokens(self) -> int: ...
    @property
    def indivisible(self) -> bool: ...


@dataclass(frozen=True)
class PrefillShape:
    """What this step's prefill may do."""

    # None: run as planned; otherwise the most tokens any chunk runs (0: none).
    cap: int | None
    # Requests whose chunk does not fit even at the floor: end them.
    ended: tuple[str, ...] = ()

    @property
    def throttled(self) -> bool:
        return self.cap is not None and self.cap > 0

    @property
    def held(self) -> bool:
        return self.cap == 0


def shape_prefill(
    plan: Sequence[PlannedChunk],
    fits: ChunkFits,
    *,
    may_hold: bool,
    floor: int = MIN_PREFILL_CHUNK,
) -> PrefillShape:
    """The largest cap (halving from the planned chunks) at which every chunk
    fits; at the floor, hold the step (``may_hold``) or end the chunks that
    still do not fit."""
    if not _not_fitting(plan, fits, cap=None):
        return PrefillShape(None)
    cap = max((c.num_tokens for c in plan), default=0) // 2
    while cap > floor:
        if not _not_fitting(plan, fits, cap):
            return PrefillShape(cap)
        cap //= 2
    failing = _not_fitting(plan, fits, floor)
    if not failing:
        return PrefillShape(floor)
    if may_hold:
        return PrefillShape(0)
    return PrefillShape(floor, tuple(failing))


def _not_fitting(plan: Sequence[PlannedChunk], fits: ChunkFits, cap: int | None) -> list[str]:
    """Requests whose chunk (capped) does not fit beside the chunks before it
    that do: the step runs them all, so their tokens add up."""
    ahead = 0
    failing = []
    for chunk in plan:
        n = chunk.num_tokens if cap is None or chunk.indivisible else min(cap, chunk.num_tokens)
        if fits(ahead + n, chunk.num_context_tokens - chunk.num_tokens):
            ahead += n
        else:
            failing.append(chunk.request_id)
    return failing
