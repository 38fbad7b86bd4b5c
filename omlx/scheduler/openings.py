"""A burst's shared openings, as the scheduler plans them. Pure: no MLX.

Requests starting together whose prompts open with the same tokens (a system
prompt, tool definitions, a chat template's preamble, a client's fixed opening
of each turn) prefill that common opening once, up to one prefill chunk, and
each starts from a copy of its cache (the runner's ``engine/openings.py``).

The prefix cache may already hold part of an opening (a burst usually shares a
cached preamble and goes on with tokens nobody sent before): the shared forward
starts where the shortest hit among the sharers ends. Sharers are picked best
first (``best_share``) and share when that saves at least MIN_SHARED_OPENING
token-rows of prefill.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from omlx.cache.prefix_index import common_prefix
from omlx.scheduler.request import Request

# Requests starting together share the prefill of their common opening when that
# saves at least this many token-rows of prefill (below, the separate forward costs
# more than it saves).
MIN_SHARED_OPENING = 16


@dataclass(frozen=True, slots=True)
class SharedOpening:
    """Prompt tokens ``[start, end)`` prefilled once for ``request_ids``, whose
    prompts all open with the same ``end`` tokens; ``start`` is the shortest of
    their cache hits (the shared forward appends to that hit's cache)."""

    request_ids: tuple[str, ...]
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def plan_openings(
    requests: Sequence[Request], cached: Mapping[str, int], step_size: int
) -> list[SharedOpening]:
    """The shared openings of requests starting together, best first, each
    request in one at most. ``cached``: each request's cached prompt tokens."""
    # Prompts in token order: requests sharing an opening sit next to each other.
    pending = sorted(requests, key=lambda r: r.prompt_ids)
    openings: list[SharedOpening] = []
    while len(pending) >= 2:
        best = best_share(pending, cached, step_size)
        if best is None:
            break
        lo, hi, start, end = best
        group, pending = pending[lo:hi], pending[:lo] + pending[hi:]
        openings.append(SharedOpening(tuple(r.request_id for r in group), start, end))
    return openings


def best_share(
    ordered: Sequence[Request], cached: Mapping[str, int], step_size: int
) -> tuple[int, int, int, int] | None:
    """The run ``ordered[lo:hi]`` (prompts in token order) whose shared opening
    saves the most token-rows of prefill: the rows each request would prefill
    itself up to the opening's end ``n``, less the rows prefilled once from
    ``start`` (the shortest hit). Each request keeps at least two tokens of its
    own to prefill. (lo, hi, start, n), or None below MIN_SHARED_OPENING."""
    adjacent = [common_prefix(a.prompt_ids, b.prompt_ids) for a, b in itertools.pairwise(ordered)]
    best, best_saved = None, MIN_SHARED_OPENING - 1
    for lo in range(len(ordered) - 1):
        n_common, start = len(ordered[lo].prompt_ids) - 2, cached[ordered[lo].request_id]
        for hi in range(lo + 2, len(ordered) + 1):
            r = ordered[hi - 1]
            n_common = min(n_common, adjacent[hi - 2], len(r.prompt_ids) - 2)
            start = min(start, cached[r.request_id])
            n = min(n_common, start + step_size)
            if n <= start:
                continue
            group = ordered[lo:hi]
            saved = sum(max(0, n - cached[q.request_id]) for q in group) - (n - start)
            if saved > best_saved:
                best, best_saved = (lo, hi, start, n), saved
    return best
