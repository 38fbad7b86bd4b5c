"""The logprobs of a prompt's own tokens (completions ``echo`` + ``logprobs``):
checked against the memory limit at the front door, scored on the MLX thread
between engine steps (scoring.py), each chunk gated like a prefill chunk."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from functools import partial

from omlx.engine.model_engine import ModelEngine
from omlx.engine.scoring import PromptScorer, scoring_chunk_tokens, scoring_transient_bytes
from omlx.engine.token_text import LogprobEntry
from omlx.errors import MemoryPressureError
from omlx.sizes import format_bytes


async def prompt_logprobs(
    engine: ModelEngine, prompt_ids: Sequence[int], top_k: int
) -> list[LogprobEntry]:
    """One entry per prompt token; the first has no logprob (nothing predicts it).
    Raises PrefillMemoryExceededError for a prompt that can never be scored. One
    chunk per turn of the MLX thread: other requests keep decoding meanwhile."""
    vocab = engine.loaded.vocab_size
    chunk = scoring_chunk_tokens(vocab, engine.guard.chunk_tokens)
    extra = scoring_transient_bytes(vocab, chunk)
    engine.guard.check_prefill(len(prompt_ids), extra_bytes=extra)
    scorer = PromptScorer(engine.loaded.model, prompt_ids, top_k=top_k, chunk_tokens=chunk)
    gate = partial(_gate, engine, extra)
    # Its KV is held between chunks: work in flight, never the idle baseline.
    await asyncio.wrap_future(engine.run_on_mlx(engine.hold_memory, True))
    try:
        while not await asyncio.wrap_future(engine.run_on_mlx(scorer.step, gate)):
            pass
    finally:
        # Its arrays are freed on the MLX thread, even when the request was cancelled.
        engine.run_on_mlx(_close, engine, scorer, even_if_closed=True)
    # On the MLX thread: the token texts come from its private tokenizer.
    text, first = engine.token_text, prompt_ids[0]
    entries = engine.run_on_mlx(
        lambda: [text.bare(first, None), *(text.entry(lp) for lp in scorer.scored)]
    )
    return await asyncio.wrap_future(entries)


def _close(engine: ModelEngine, scorer: PromptScorer) -> None:
    """MLX thread: the scorer's arrays go, and with them its hold on memory."""
    scorer.close()
    engine.hold_memory(False)


def _gate(engine: ModelEngine, extra: int, num_tokens: int, num_cached: int) -> None:
    """MLX thread: the forward gate for a scoring chunk, its logits counted."""
    reading = engine.probe.reading(fresh=True)
    reading = dataclasses.replace(
        reading,
        mlx_active_bytes=reading.mlx_active_bytes + extra,
        process_footprint_bytes=reading.process_footprint_bytes + extra,
    )
    if not engine.guard.gate(num_tokens, num_cached, reading, others=engine.has_work):
        raise MemoryPressureError(
            "scoring the prompt would take memory past the "
            f"{format_bytes(engine.guard.limits.hard_bytes)} limit because of other "
            "work; retry shortly, or send a shorter prompt"
        )
