"""The front door counts a scoring pass's logits (completions echo + logprobs)."""

from __future__ import annotations

import pytest

from omlx.engine.scoring import (
    SCORING_LOGITS_BYTES,
    scoring_chunk_tokens,
    scoring_transient_bytes,
)
from omlx.errors import PrefillMemoryExceededError
from omlx.memory.budget import Limits
from omlx.memory.dims import ModelDims
from omlx.memory.guard import MemoryGuard

MIB = 2**20
DIMS = ModelDims(num_layers=4, num_kv_heads=2, head_dim=64, num_attention_heads=4, hidden_size=256)


def test_a_large_vocabulary_scores_in_smaller_chunks() -> None:
    assert scoring_chunk_tokens(32_000, 512) == 512
    small = scoring_chunk_tokens(152_000, 512)
    assert small < 512 and small * 152_000 * 4 <= SCORING_LOGITS_BYTES
    assert scoring_chunk_tokens(10**9, 512) == 1  # never zero


def test_preflight_refuses_a_prompt_whose_scoring_logits_do_not_fit() -> None:
    limits = Limits(hard_bytes=400 * MIB, soft_bytes=300 * MIB, transient_margin_bytes=64 * MIB)
    guard = MemoryGuard("m", DIMS, limits=limits, baseline=lambda: 200 * MIB, chunk_tokens=512)
    guard.check_prefill(1000)  # generating from it fits
    chunk = scoring_chunk_tokens(152_000, 512)
    with pytest.raises(PrefillMemoryExceededError):
        guard.check_prefill(1000, extra_bytes=scoring_transient_bytes(152_000, chunk))
