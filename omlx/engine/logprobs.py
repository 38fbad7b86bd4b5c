"""Log-probabilities of sampled tokens, for the requests that ask. MLX thread only.

The distribution is the log-softmax of the logits after the logits processors
(repetition penalty, grammar mask) and before temperature, top-p, top-k and
min-p: vLLM's "processed_logits" mode. Greedy requests so get meaningful values,
and a value does not depend on how the token was drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from omlx.mlx_types import float_list, float_rows, int_rows
from omlx.scheduler import TokenLogprob

# What OpenAI reports for a token with no probability at all (a masked one):
# JSON has no -inf.
FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class PendingLogprobs:
    """Lazy arrays for some rows of a step: the chosen tokens' logprobs (rows,)
    and the ``k`` best ids and logprobs (rows, k), best first."""

    chosen: mx.array
    top_ids: mx.array | None
    top_logprobs: mx.array | None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_logprobs) if a is not None]

    def to_python(self, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
        """One TokenLogprob per row, with that row's own ``k`` alternatives."""
        chosen = float_list(self.chosen)
        ids = int_rows(self.top_ids) if self.top_ids is not None else [[]] * len(ks)
        lps = float_rows(self.top_logprobs) if self.top_logprobs is not None else [[]] * len(ks)
        out = []
        for row, (token, k) in enumerate(zip(tokens, ks, strict=True)):
            top = tuple((i, _finite(v)) for i, v in zip(ids[row][:k], lps[row][:k], strict=True))
            out.append(TokenLogprob(int(token), _finite(chosen[row]), top))
        return out


def log_softmax(logits: mx.array) -> mx.array:
    """In float32: half-precision logprobs of a large vocabulary lose digits."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def pending_logprobs(logits: mx.array, tokens: mx.array, k: int) -> PendingLogprobs:
    """``logits`` (rows, vocab) after the processors; ``tokens`` (rows,) the sampled
    ones; ``k`` alternatives per row (the largest any of these rows asked for)."""
    lp = log_softmax(logits)
    chosen = mx.take_along_axis(lp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    k = min(k, lp.shape[-1])
    if k <= 0:
        return PendingLogprobs(chosen, None, None)
    # A partition then a sort of the k: the vocabulary is never sorted.
    ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return PendingLogprobs(
        chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    )


def _finite(value: float) -> float:
    return FLOOR if math.isnan(value) or value < FLOOR else float(value)
