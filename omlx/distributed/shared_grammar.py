"""Structured output (a grammar) on a model split across ranks. Every rank samples its
own token from the same logits, so all must sample from the same masked logits: rank
0 alone keeps the grammar (its matcher, its CPU-time guard) and, at each step of a
grammar row, hands its masked logits to every rank in one ``all_sum`` (the others add
zeros). The followers never compile or match anything: a request's grammar pickles
to a ``MirroredGrammar`` on its way to them.

The sum is evaluated at once on every rank, after the step's logits (rank 0's matcher
reads them; a follower evaluates them first), so each rank meets the forward's
collectives before this one, in the same order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omlx.grammar.processor import StepOverrun


class SharedGrammar:
    """Rank 0's grammar of a request (``inner``: its BoundGrammar), shared by its sums."""

    def __init__(self, inner: Any):
        self.inner = inner

    @property
    def overrun(self) -> StepOverrun:
        return self.inner.overrun  # type: ignore[no-any-return]

    def new_processor(self, *, draw: Any = None) -> _Shared:
        return _Shared(self.inner.new_processor(draw=draw))

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return MirroredGrammar, ()  # what a follower receives


class MirroredGrammar:
    """A follower's stand-in for rank 0's grammar: its processor takes rank 0's logits."""

    def __init__(self) -> None:
        self.overrun = StepOverrun()  # never set: rank 0 ends an overrunning request

    def new_processor(self, *, draw: Any = None) -> _Mirror:
        return _Mirror()


class _Shared:
    def __init__(self, inner: Any):
        self._inner = inner

    def replay(self, tokens: Sequence[int]) -> None:
        self._inner.replay(tokens)

    def __call__(self, tokens: Any, logits: Any) -> Any:
        return _from_rank_0(self._inner(tokens, logits))


class _Mirror:
    def replay(self, tokens: Sequence[int]) -> None:
        pass  # the matcher is rank 0's

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        mx.eval(logits)  # as rank 0's matcher does: the forward's collectives first
        return _from_rank_0(mx.zeros_like(logits))


def _from_rank_0(logits: Any) -> Any:
    import mlx.core as mx

    shared = mx.distributed.all_sum(logits)
    mx.eval(shared)
    return shared
