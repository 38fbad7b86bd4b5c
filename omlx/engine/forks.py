"""A request's ``n`` choices: one prompt prefilled once. MLX thread only.

Requests starting together with the very same prompt (the choices of one
request) share it: the first one (the leader) prefills it, the others wait, and
when the leader's prompt is in, each of them joins the decode batch with a copy
of the leader's cache and the same last prompt token, from which it samples its
own first token. The runner's shared opening already covers prompts within one
prefill chunk (all but their last two tokens, in one forward); this covers
longer ones, whose later chunks each choice would otherwise prefill itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from omlx.engine.batch import Row, merge_caches
from omlx.mlx_types import BatchCacheLayer
from omlx.scheduler import Request

# Prompts longer than one prefill chunk by this much fork: shorter ones the shared
# opening covers (all but their last two tokens, in one forward).
FORK_PAST_OPENING = 3

# Makes a request's batch row whose processors have seen ``fed`` tokens.
RowFactory = Callable[[Request, Sequence[int]], Row]


class ChoiceForks:
    """Which choices wait for which leader is the plan's (scheduler/placement.py)."""

    def __init__(self, make_row: RowFactory):
        self._make_row = make_row
        # Leader request id -> the requests waiting for its prompt.
        self._waiting: dict[str, list[Request]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def leaders(self) -> dict[str, str]:
        """Each waiting choice -> its leader."""
        return {r.request_id: lead for lead, waiting in self._waiting.items() for r in waiting}

    def wait(self, request: Request, leader_id: str) -> None:
        """``request`` starts from its leader's cache once the leader's prompt is in."""
        self._waiting.setdefault(leader_id, []).append(request)

    def fork(
        self, rows: list[Row], feed: list[int], cache: list[BatchCacheLayer]
    ) -> tuple[list[Row], list[int], list[BatchCacheLayer]]:
        """Rows whose prompt just ended (their batched ``cache``, their last prompt
        tokens ``feed``), with the requests waiting on them added after each."""
        if not any(row.request_id in self._waiting for row in rows):
            return rows, feed, cache
        out_rows, out_feed, caches = [], [], []
        for i, (row, token) in enumerate(zip(rows, feed, strict=True)):
            own = [layer.extract(i) for layer in cache]
            out_rows.append(row)
            out_feed.append(token)
            caches.append(own)
            for r in self._waiting.pop(row.request_id, []):
                out_rows.append(self._make_row(r, r.prompt_ids[:-1]))
                out_feed.append(token)
                caches.append(own)  # merged into new arrays: each row its own copy
        return out_rows, out_feed, merge_caches(caches)

    def drop(self, request_ids: set[str]) -> list[Request]:
        """Forget waiting requests that leave; returns those whose leader left
        (still waiting: the caller starts them on their own)."""
        orphans = []
        for leader in list(self._waiting):
            staying = [r for r in self._waiting.pop(leader) if r.request_id not in request_ids]
            if leader in request_ids:
                orphans += staying
            elif staying:
                self._waiting[leader] = staying
        return orphans

    def clear(self) -> None:
        self._waiting.clear()
