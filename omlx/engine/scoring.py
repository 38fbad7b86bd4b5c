"""Teacher-forced scoring: the logprob of every prompt token given the ones
before it (completions ``echo`` + ``logprobs``, lm-eval-harness's loglikelihood).
MLX thread only.

Its own forward over the prompt, in chunks on a fresh cache: decoding needs the
logits of one position, scoring of every position, so a chunk's logits are
(chunk, vocab) and the chunk is sized to keep them under SCORING_LOGITS_BYTES
whatever the prompt's length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from omlx.engine.logprobs import pending_logprobs
from omlx.mlx_types import CacheLayer, LanguageModel, prompt_cache
from omlx.scheduler import TokenLogprob

# One chunk's float32 logits stay under this (64 MiB: ~110 positions of a
# 150k vocabulary, the prefill chunk for a 32k one).
SCORING_LOGITS_BYTES = 64 * 2**20
# The logits, their float32 log-softmax and the top-k's partition, alive together.
_LOGIT_COPIES = 3

# Asked before each chunk's forward: (chunk tokens, tokens already in the cache).
ChunkGate = Callable[[int, int], None]


def scoring_chunk_tokens(vocab_size: int, prefill_step_size: int) -> int:
    """Positions scored per forward: a prefill chunk, fewer for a large vocabulary."""
    return max(1, min(prefill_step_size, SCORING_LOGITS_BYTES // (4 * max(vocab_size, 1))))


def scoring_transient_bytes(vocab_size: int, chunk_tokens: int) -> int:
    """What a scoring chunk holds beyond a prefill chunk: its logits and their copies."""
    return _LOGIT_COPIES * 4 * vocab_size * chunk_tokens


class PromptScorer:
    """Scores one prompt a chunk per ``step``, so engine steps (other requests'
    decoding) run in between. Made anywhere; ``step`` and ``close`` on the MLX
    thread only (its arrays are made by the first step and freed by ``close``)."""

    def __init__(
        self, model: LanguageModel, prompt_ids: Sequence[int], *, top_k: int, chunk_tokens: int
    ):
        self._model = model
        self._prompt = list(prompt_ids)
        self._top_k = top_k
        self._chunk = chunk_tokens
        self._cache: list[CacheLayer] | None = None
        self._ids: mx.array | None = None
        self._pos = 0
        # The logprob of prompt token i + 1 at index i (plain Python).
        self.scored: list[TokenLogprob] = []

    def step(self, before_chunk: ChunkGate | None = None) -> bool:
        """Score the next chunk; True once the whole prompt is scored."""
        last = len(self._prompt) - 1  # the last token is predicted, never fed
        if self._pos >= last:
            return True
        if self._cache is None or self._ids is None:
            self._cache, self._ids = prompt_cache(self._model), mx.array(self._prompt)
        start, end = self._pos, min(self._pos + self._chunk, last)
        if before_chunk is not None:
            before_chunk(end - start, start)
        logits = self._model(self._ids[None, start:end], cache=self._cache)[0]
        pending = pending_logprobs(logits, self._ids[start + 1 : end + 1], self._top_k)
        mx.eval(pending.arrays())
        self.scored += pending.to_python(
            self._prompt[start + 1 : end + 1], [self._top_k] * (end - start)
        )
        self._pos = end
        if end >= last:
            self.close()
        return end >= last

    def close(self) -> None:
        if self._cache is not None:
            self._cache = self._ids = None
            mx.clear_cache()


def score_prompt(
    model: LanguageModel,
    prompt_ids: Sequence[int],
    *,
    top_k: int,
    chunk_tokens: int,
    before_chunk: ChunkGate | None = None,
) -> list[TokenLogprob]:
    """The logprob of ``prompt_ids[i]`` given ``prompt_ids[:i]`` for i >= 1 (the first
    token has none), each with its ``top_k`` best alternatives, in one call."""
    scorer = PromptScorer(model, prompt_ids, top_k=top_k, chunk_tokens=chunk_tokens)
    try:
        while not scorer.step(before_chunk):
            pass
    finally:
        scorer.close()
    return scorer.scored
