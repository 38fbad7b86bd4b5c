"""A hybrid's fixed per-sequence states in the guard's pure arithmetic (issue 40): the
KV capacity counts each row's states in KV tokens, the front door and admission
estimate a new sequence's, the fit estimate prices every concurrent request's. A
model without such layers has a state of 0 and every figure exactly as before."""

from __future__ import annotations

import dataclasses

import pytest

from omlx.errors import PrefillMemoryExceededError
from omlx.memory.budget import Limits, MemoryReading, estimate_prefill
from omlx.memory.dims import ModelDims, gated_delta_state_bytes, model_dims
from omlx.memory.fit import estimate_fit
from omlx.memory.guard import MemoryGuard
from omlx.memory.kv_profile import KVProfile

MIB = 2**20
GIB = 2**30
DIMS = ModelDims(num_layers=4, num_kv_heads=2, head_dim=64, num_attention_heads=4, hidden_size=256)
# The shape fields of Qwen3-Next-80B-A3B's published config.json: 48 layers, every
# fourth full attention, the others gated-delta.
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
LINEAR_KEYS = [k for k in QWEN3_NEXT if k.startswith("linear_")]


def test_a_qwen3_next_sequence_holds_tens_of_megabytes_of_state() -> None:
    per_layer = 3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 4  # conv bf16, state f32
    assert gated_delta_state_bytes(QWEN3_NEXT, kv_dtype_bytes=2) == 36 * per_layer
    assert 70 * MIB < 36 * per_layer < 80 * MIB
    nested = {"model_type": "qwen3_5", "text_config": QWEN3_NEXT}
    assert gated_delta_state_bytes(nested, kv_dtype_bytes=2) == 36 * per_layer
    plain = {k: v for k, v in QWEN3_NEXT.items() if k not in LINEAR_KEYS}
    assert gated_delta_state_bytes(plain, kv_dtype_bytes=2) == 0


def test_a_row_costs_the_kv_capacity_its_state_in_tokens() -> None:
    dims = dataclasses.replace(DIMS, state_bytes_per_sequence=10 * DIMS.kv_bytes_per_token + 1)
    assert dims.state_tokens_per_sequence == 11  # rounded up
    limits = Limits(hard_bytes=4 * GIB, soft_bytes=3 * GIB, transient_margin_bytes=64 * MIB)
    guard = MemoryGuard("m", dims, limits=limits, baseline=lambda: 200 * MIB, chunk_tokens=512)
    guard.set_profile(KVProfile(max_kv_tokens=1000, source="explicit", baseline_bytes=0))
    assert guard.kv_fits(1000 - 3 * 11, 0, 3)
    assert not guard.kv_fits(1000 - 3 * 11 + 1, 0, 3)
    # A lone prompt, the token its first decode step adds and its state fill the capacity
    # (kv_step 1: no growth slack; allocated_columns).
    guard.check_prefill(1000 - 11 - 1)
    with pytest.raises(PrefillMemoryExceededError, match="more KV cache than the 1000 tokens"):
        guard.check_prefill(1000 - 11)
    blind = MemoryGuard("m", DIMS, limits=limits, baseline=lambda: 200 * MIB, chunk_tokens=512)
    blind.set_profile(KVProfile(max_kv_tokens=1000, source="explicit", baseline_bytes=0))
    assert blind.kv_fits(1000, 0, 3)  # no state: rows cost only their tokens, as before


def test_a_new_sequence_s_state_is_in_its_prefill_estimate() -> None:
    state = 5 * MIB
    reading = MemoryReading(GIB, GIB, GIB, taken_at_s=0.0)
    limits = Limits(hard_bytes=4 * GIB, soft_bytes=3 * GIB, transient_margin_bytes=64 * MIB)

    def peak(dims: ModelDims) -> int:
        return estimate_prefill(
            dims,
            reading,
            num_new_tokens=300,
            num_cached_tokens=0,
            chunk_tokens=512,
            limits=limits,
            others_in_flight=True,
        ).peak_bytes

    hybrid = dataclasses.replace(DIMS, state_bytes_per_sequence=state)
    assert peak(hybrid) - peak(DIMS) == state


def test_the_fit_prices_every_concurrent_request_s_state() -> None:
    fit = estimate_fit(
        QWEN3_NEXT, 40 * GIB, limit_bytes=120 * GIB, concurrency=8, context_tokens=4096
    )
    state = gated_delta_state_bytes(QWEN3_NEXT, kv_dtype_bytes=2)
    dims = model_dims(QWEN3_NEXT, kv_dtype_bytes=2)
    assert dims is not None
    assert fit.state_bytes == 8 * state
    assert fit.kv_bytes == dims.kv_bytes(8 * 4096) + 8 * state
    assert any("linear layers' state" in note for note in fit.notes)
    plain = {k: v for k, v in QWEN3_NEXT.items() if k not in LINEAR_KEYS}
    blind = estimate_fit(plain, 40 * GIB, limit_bytes=120 * GIB, concurrency=8, context_tokens=4096)
    assert fit.total_bytes - blind.total_bytes >= 8 * state
    assert blind.state_bytes == 0 and blind.kv_bytes == dims.kv_bytes(8 * 4096)
    # Under a tight limit the states leave room for a shorter context than without.
    tight = {"limit_bytes": 44 * GIB, "concurrency": 8}
    short = estimate_fit(QWEN3_NEXT, 40 * GIB, **tight).max_context_tokens
    longer = estimate_fit(plain, 40 * GIB, **tight).max_context_tokens
    assert short is not None and longer is not None and short < longer
