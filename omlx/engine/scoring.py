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
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.engine.logprobs import pending_logprobs
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


def score_prompt(
    model: Any,
    prompt_ids: Sequence[int],
    *,
    top_k: int,
    chunk_tokens: int,
    before_chunk: ChunkGate | None = None,
) -> list[TokenLogprob]:
    """The logprob of ``prompt_ids[i]`` given ``prompt_ids[:i]`` for i >= 1 (the first
    token has none), each with its ``top_k`` best alternatives."""
    cache = make_prompt_cache(model)
    ids = mx.array(list(prompt_ids))
    out: list[TokenLogprob] = []
    last = len(prompt_ids) - 1  # the last token is predicted, never fed
    for start in range(0, last, chunk_tokens):
        end = min(start + chunk_tokens, last)
        if before_chunk is not None:
            before_chunk(end - start, start)
        logits = model(ids[None, start:end], cache=cache)[0]
        pending = pending_logprobs(logits, ids[start + 1 : end + 1], top_k)
        mx.eval(pending.arrays())
        out += pending.to_python(prompt_ids[start + 1 : end + 1], [top_k] * (end - start))
    mx.clear_cache()
    return out
