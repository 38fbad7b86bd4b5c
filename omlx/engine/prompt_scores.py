"""The logprobs of a prompt's own tokens (completions ``echo`` + ``logprobs``):
checked against the memory limit at the front door, scored on the MLX thread
between engine steps (scoring.py), each chunk gated like a prefill chunk."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from omlx.engine.model_engine import ModelEngine
from omlx.engine.scoring import score_prompt, scoring_chunk_tokens, scoring_transient_bytes
from omlx.engine.token_text import LogprobEntry
from omlx.errors import MemoryPressureError
from omlx.sizes import format_bytes


async def prompt_logprobs(
    engine: ModelEngine, prompt_ids: Sequence[int], top_k: int
) -> list[LogprobEntry]:
    """One entry per prompt token; the first has no logprob (nothing predicts it).
    Raises PrefillMemoryExceededError for a prompt that can never be scored."""
    vocab = engine.loaded.vocab_size
    chunk = scoring_chunk_tokens(vocab, engine.guard.chunk_tokens)
    extra = scoring_transient_bytes(vocab, chunk)
    engine.guard.check_prefill(len(prompt_ids), extra_bytes=extra)
    future = engine.run_on_mlx(_score, engine, list(prompt_ids), top_k, chunk, extra)
    return await asyncio.wrap_future(future)  # type: ignore[no-any-return]


def _score(
    engine: ModelEngine, prompt_ids: list[int], top_k: int, chunk: int, extra: int
) -> list[LogprobEntry]:
    """MLX thread."""

    def gate(num_tokens: int, num_cached: int) -> None:
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

    scored = score_prompt(
        engine.loaded.model, prompt_ids, top_k=top_k, chunk_tokens=chunk, before_chunk=gate
    )
    text = engine.token_text
    return [text.bare(prompt_ids[0], None), *(text.entry(lp) for lp in scored)]
