"""Memory budget: config dims, limits, the estimate, front door, admission, forward gate."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random

import pytest

from omlx.memory.budget import (
    AdmitAction,
    BatchTransient,
    Limits,
    MemoryReading,
    ModelDims,
    PrefillEstimate,
    PrefillMemoryExceeded,
    admit,
    apply_measured_margin,
    attention_transient_bytes,
    canary_bytes,
    conservative_dims,
    estimate_prefill,
    fused_sdpa_applies,
    gate,
    guard_dims,
    kv_capacity_tokens,
    measured_margin_bytes,
    model_dims,
    preflight,
    resolve_limits,
    unmodeled_transient_bytes,
)
from omlx.memory.dims import rank_share

MIB = 1 << 20
GIB = 1024**3
LLAMA_8B = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
}


def _dims(
    head_dim: int = 128, *, heads: int = 32, kv_heads: int = 8, layers: int = 32
) -> ModelDims:
    return ModelDims(layers, kv_heads, head_dim, heads, heads * head_dim)


def _reading(resident: int, recent_peak: int = 0) -> MemoryReading:
    return MemoryReading(resident, resident, recent_peak, taken_at_s=0.0)


def _limits(hard: int, margin: int = 0) -> Limits:
    return Limits(hard_bytes=hard, soft_bytes=int(hard * 0.85), transient_margin_bytes=margin)


# -- dimensions ---------------------------------------------------------------------------


def test_plain_llama_config() -> None:
    dims = model_dims(LLAMA_8B, kv_dtype_bytes=2)
    assert dims == ModelDims(32, 8, 128, 32, 4096, 2)
    assert dims.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_float32_kv_doubles_bytes_per_token() -> None:
    dims = model_dims(LLAMA_8B, kv_dtype_bytes=4)
    assert dims is not None and dims.kv_bytes_per_token == 2 * 32 * 8 * 128 * 4


def test_nested_vlm_text_config_wins_over_vision_numbers() -> None:
    config = {
        "num_hidden_layers": 48,  # the vision encoder's, leaked to the top level
        "num_attention_heads": 40,
        "hidden_size": 5120,
        "vision_config": {"num_hidden_layers": 48, "num_attention_heads": 40, "hidden_size": 5120},
        "text_config": {
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2048,
        },
    }
    assert model_dims(config, kv_dtype_bytes=2) == ModelDims(28, 4, 256, 16, 2048, 2)


@pytest.mark.parametrize("key", ["language_config", "llm_config", "language_model"])
def test_other_lm_subconfig_names(key: str) -> None:
    config = {"num_hidden_layers": 99, "num_attention_heads": 99, "hidden_size": 99 * 64}
    config[key] = LLAMA_8B  # type: ignore[assignment]
    dims = model_dims(config, kv_dtype_bytes=2)
    assert dims is not None and dims.num_layers == 32


def test_gpt2_legacy_names() -> None:
    dims = model_dims({"n_layer": 12, "n_head": 12, "n_embd": 768}, kv_dtype_bytes=2)
    assert dims == ModelDims(12, 12, 64, 12, 768, 2)  # KV heads = heads, head_dim = 768 / 12


def test_falcon_n_head_kv_and_multi_query() -> None:
    falcon_40b = {"n_layer": 60, "n_head": 128, "n_head_kv": 8, "hidden_size": 8192}
    falcon_7b = {"n_layer": 32, "n_head": 71, "multi_query": True, "hidden_size": 4544}
    assert model_dims(falcon_40b, kv_dtype_bytes=2) == ModelDims(60, 8, 64, 128, 8192, 2)
    dims = model_dims(falcon_7b, kv_dtype_bytes=2)
    assert dims is not None and (dims.num_kv_heads, dims.head_dim) == (1, 64)


def test_null_head_dim_is_derived() -> None:
    dims = model_dims({**LLAMA_8B, "head_dim": None, "num_key_value_heads": None}, kv_dtype_bytes=2)
    assert dims == ModelDims(32, 32, 128, 32, 4096, 2)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"architectures": ["Foo"], "vision_config": {"num_hidden_layers": 24}},
        {"num_hidden_layers": 32, "num_attention_heads": 32},  # no hidden size, no head_dim
        {"num_hidden_layers": 32, "num_attention_heads": 3, "hidden_size": 4096},  # not divisible
        {"num_hidden_layers": True, "num_attention_heads": 32, "hidden_size": 4096},
    ],
)
def test_unresolvable_config_gives_none_and_a_conservative_fallback(
    config: dict[str, object],
) -> None:
    assert model_dims(config, kv_dtype_bytes=2) is None
    fallback = conservative_dims(config, kv_dtype_bytes=2)
    assert not fused_sdpa_applies(fallback.head_dim)  # score matrix is always counted


def test_empty_config_fallback_is_larger_than_a_real_model() -> None:
    fallback = conservative_dims({}, kv_dtype_bytes=2)
    real = model_dims(LLAMA_8B, kv_dtype_bytes=2)
    assert real is not None and fallback.kv_bytes_per_token >= 4 * real.kv_bytes_per_token
    assert fallback.num_layers == 80 and fallback.num_kv_heads == 8


def test_conservative_keeps_the_fields_it_can_read() -> None:
    fallback = conservative_dims(
        {"num_hidden_layers": 40, "num_attention_heads": 32}, kv_dtype_bytes=2
    )
    assert (fallback.num_layers, fallback.num_attention_heads, fallback.num_kv_heads) == (40, 32, 8)


def test_guard_dims_warns_on_fallback_and_never_returns_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="omlx.memory.budget"):
        resolved = guard_dims(LLAMA_8B, kv_dtype_bytes=2, model="llama")
        fallback = guard_dims({}, kv_dtype_bytes=2, model="mystery")
    assert resolved == model_dims(LLAMA_8B, kv_dtype_bytes=2)
    assert fallback == conservative_dims({}, kv_dtype_bytes=2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "mystery" in warnings[0].getMessage()


# -- attention transient and the estimate -------------------------------------------------


@pytest.mark.parametrize(
    ("head_dim", "fused"), [(64, True), (80, True), (128, True), (96, False), (256, False)]
)
def test_fused_sdpa_head_dims(head_dim: int, fused: bool) -> None:
    assert fused_sdpa_applies(head_dim) is fused


def test_cached_tokens_grow_the_unfused_score_matrix() -> None:
    dims = _dims(head_dim=256, heads=16)
    reading, limits = _reading(10 * GIB), _limits(100 * GIB, margin=GIB)
    cold = estimate_prefill(
        dims,
        reading,
        num_new_tokens=1000,
        num_cached_tokens=0,
        chunk_tokens=512,
        limits=limits,
        others_in_flight=False,
    )
    warm = estimate_prefill(
        dims,
        reading,
        num_new_tokens=1000,
        num_cached_tokens=9000,
        chunk_tokens=512,
        limits=limits,
        others_in_flight=False,
    )
    assert cold.attention_bytes == 512 * 1000 * 16 * 4
    assert warm.attention_bytes == 512 * 10_000 * 16 * 4
    assert warm.kv_bytes == cold.kv_bytes == dims.kv_bytes_per_token * 1000
    # Growing the cache copies all of it (cached tokens included) once.
    assert warm.growth_bytes == dims.kv_bytes_per_token * 10_000
    assert cold.growth_bytes == dims.kv_bytes_per_token * 1000
    assert warm.peak_bytes == (
        10 * GIB + warm.kv_bytes + warm.attention_bytes + GIB + warm.growth_bytes
    )


def test_fused_transient_ignores_attention_length() -> None:
    dims = _dims(head_dim=128, heads=32)
    short = attention_transient_bytes(dims, chunk_tokens=512, num_context_tokens=512)
    long = attention_transient_bytes(dims, chunk_tokens=512, num_context_tokens=100_000)
    assert short == long == 512 * 32 * 128 * 4


def test_chunk_larger_than_prompt_counts_only_the_prompt() -> None:
    dims = _dims(head_dim=256, heads=8)
    est = estimate_prefill(
        dims,
        _reading(0),
        num_new_tokens=100,
        num_cached_tokens=0,
        chunk_tokens=2048,
        limits=_limits(GIB),
        others_in_flight=False,
    )
    assert est.attention_bytes == 100 * 100 * 8 * 4


# -- limits and readings ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ram", "hard"),
    [
        (128 * GIB, 128 * GIB - int(128 * GIB * 0.15)),  # 15% reserve
        (8 * GIB, 6 * GIB),  # 2 GiB floor
        (2 * GIB, 1 * GIB),  # never more than half reserved
    ],
)
def test_auto_limit_scales_the_reserve(ram: int, hard: int) -> None:
    limits = resolve_limits("auto", total_ram_bytes=ram, transient_margin_bytes=0)
    assert limits.hard_bytes == hard
    assert limits.soft_bytes == int(hard * 0.85)


@pytest.mark.parametrize(
    ("value", "hard"),
    [("50%", 32 * GIB), ("24GB", 24 * 1000**3), (40 * GIB, 40 * GIB), (" AUTO ", None)],
)
def test_explicit_limit_is_the_hard_limit_itself(value: str | int, hard: int | None) -> None:
    limits = resolve_limits(
        value, total_ram_bytes=64 * GIB, soft_fraction=0.5, transient_margin_bytes=GIB
    )
    if hard is not None:
        assert limits.hard_bytes == hard
    assert limits.soft_bytes == int(limits.hard_bytes * 0.5)
    assert limits.transient_margin_bytes == GIB


@pytest.mark.parametrize("value", ["65GiB", 65 * GIB, "lots", "0", "150%"])
def test_bad_ceiling_names_the_field(value: str | int) -> None:
    with pytest.raises(ValueError, match="max_process_memory"):
        resolve_limits(value, total_ram_bytes=64 * GIB, transient_margin_bytes=0)


def test_margin_must_leave_room() -> None:
    with pytest.raises(ValueError, match="prefill_transient_margin"):
        resolve_limits("8GiB", total_ram_bytes=64 * GIB, transient_margin_bytes=8 * GIB)
    with pytest.raises(ValueError, match="soft_fraction"):
        resolve_limits(
            "8GiB", total_ram_bytes=64 * GIB, soft_fraction=1.5, transient_margin_bytes=0
        )


@pytest.mark.parametrize(("active", "footprint", "peak"), [(9, 2, 3), (2, 9, 3), (2, 3, 9)])
def test_high_water_is_the_max_of_three(active: int, footprint: int, peak: int) -> None:
    reading = MemoryReading(active, footprint, peak, taken_at_s=1.0)
    assert reading.high_water == 9
    assert reading.current_bytes(others_in_flight=True) == 9
    assert reading.current_bytes(others_in_flight=False) == max(active, footprint)


# -- front door ---------------------------------------------------------------------------


def test_preflight_passes_what_fits_and_refuses_what_never_can() -> None:
    dims = _dims()
    kwargs = {"num_new_tokens": 10_000, "num_cached_tokens": 0, "chunk_tokens": 512}
    est = preflight(dims, baseline_bytes=8 * GIB, limits=_limits(16 * GIB, GIB), **kwargs)
    assert est.peak_bytes <= 16 * GIB
    limits = _limits(est.peak_bytes - 1, GIB)
    with pytest.raises(PrefillMemoryExceeded) as info:
        preflight(dims, baseline_bytes=8 * GIB, limits=limits, **kwargs)
    assert info.value.estimated_bytes == est.peak_bytes
    assert info.value.limit_bytes == est.peak_bytes - 1
    assert "shorten the prompt" in info.value.hint


def test_preflight_hint_names_the_knob() -> None:
    unfused = _dims(head_dim=256, heads=64)
    with pytest.raises(PrefillMemoryExceeded, match="prefill_step_size"):
        preflight(
            unfused,
            baseline_bytes=GIB,
            num_new_tokens=50_000,
            num_cached_tokens=0,
            chunk_tokens=4096,
            limits=_limits(20 * GIB),
        )
    with pytest.raises(PrefillMemoryExceeded, match="smaller model"):
        preflight(
            unfused,
            baseline_bytes=20 * GIB,
            num_new_tokens=1,
            num_cached_tokens=0,
            chunk_tokens=1,
            limits=_limits(20 * GIB),
        )


# -- admission ----------------------------------------------------------------------------


def _estimate(peak: int) -> PrefillEstimate:
    return PrefillEstimate(current_bytes=peak, kv_bytes=0, attention_bytes=0, margin_bytes=0)


def test_lone_request_is_always_admitted() -> None:
    decision = admit(_estimate(50 * GIB), _limits(10 * GIB), num_in_flight=0)
    assert decision.action is AdmitAction.ADMIT and decision.admitted
    assert "nothing in flight" in decision.reason


def test_deferred_when_in_flight_and_over() -> None:
    decision = admit(_estimate(10 * GIB + 1), _limits(10 * GIB), num_in_flight=2)
    assert decision.action is AdmitAction.DEFER and not decision.admitted
    assert "2 in flight" in decision.reason


def test_admitted_when_in_flight_and_under() -> None:
    assert admit(_estimate(10 * GIB), _limits(10 * GIB), num_in_flight=3).admitted


# -- forward gate -------------------------------------------------------------------------


def _random_scenario(rng: random.Random) -> tuple[ModelDims, MemoryReading, int, int, int, bool]:
    dims = _dims(
        head_dim=rng.choice([64, 80, 96, 128, 256]),
        heads=rng.choice([8, 16, 32, 64]),
        kv_heads=rng.choice([1, 4, 8]),
        layers=rng.randint(4, 80),
    )
    resident = rng.randint(1, 60) * GIB
    reading = MemoryReading(
        mlx_active_bytes=resident - rng.randint(0, GIB),
        process_footprint_bytes=resident,
        recent_peak_bytes=resident + rng.randint(0, 4 * GIB),
        taken_at_s=0.0,
    )
    return (
        dims,
        reading,
        rng.randint(1, 40_000),
        rng.randint(0, 40_000),
        rng.choice([100, 256, 512, 2048, 8192]),
        rng.random() < 0.5,
    )


def test_admitted_request_never_trips_the_gate_under_static_memory() -> None:
    """Static: others hold still; our resident memory grows only by the KV the estimate counted,
    and the recent peak rises only to our own previous chunk's peak (resident + KV + transient)."""
    rng = random.Random(20260610)
    for _ in range(300):
        dims, reading, num_new, num_cached, chunk, others = _random_scenario(rng)
        margin = rng.randint(0, 12) * GIB
        # The auto-profile's measured transient beyond the modeled terms, if any.
        unmodeled = rng.choice([0, rng.randint(1, 4096) * MIB])
        est = estimate_prefill(
            dims,
            reading,
            num_new_tokens=num_new,
            num_cached_tokens=num_cached,
            chunk_tokens=chunk,
            limits=_limits(1, margin),
            others_in_flight=others,
            unmodeled_bytes=unmodeled,
        )
        limits = _limits(
            est.peak_bytes + rng.choice([0, 1, GIB]), margin
        )  # admitted, often exactly
        assert admit(est, limits, num_in_flight=int(others)).admitted
        done, recent_peak = 0, reading.recent_peak_bytes
        while done < num_new:
            size = min(chunk, num_new - done)
            grown = dims.kv_bytes_per_token * done
            now = MemoryReading(
                reading.mlx_active_bytes + grown,
                reading.process_footprint_bytes + grown,
                recent_peak,
                0.0,
            )
            assert gate(
                dims,
                now,
                chunk_tokens=size,
                num_cached_tokens=num_cached + done,
                limits=limits,
                others_in_flight=others,
                unmodeled_bytes=unmodeled,
            ), (dims, num_new, num_cached, chunk)
            transient = unmodeled + attention_transient_bytes(
                dims, chunk_tokens=size, num_context_tokens=num_cached + done + size
            )
            recent_peak = max(
                recent_peak, now.resident_bytes + dims.kv_bytes_per_token * size + transient
            )
            done += size


def test_gate_fires_under_drift() -> None:
    """Another request grew memory after admission: one byte past the first chunk's slack fires."""
    rng = random.Random(7)
    for _ in range(500):
        dims, reading, num_new, num_cached, chunk, others = _random_scenario(rng)
        est = estimate_prefill(
            dims,
            reading,
            num_new_tokens=num_new,
            num_cached_tokens=num_cached,
            chunk_tokens=chunk,
            limits=_limits(1, GIB),
            others_in_flight=others,
        )
        limits = _limits(est.peak_bytes, GIB)
        size = min(chunk, num_new)
        chunk_need = (
            dims.kv_bytes_per_token * size
            + dims.kv_bytes_per_token * (num_cached + size)  # the cache growth copy
            + attention_transient_bytes(
                dims, chunk_tokens=size, num_context_tokens=num_cached + size
            )
        )
        slack = (
            est.current_bytes + est.kv_bytes + est.attention_bytes + est.growth_bytes - chunk_need
        )
        for drift, proceeds in ((0, True), (1, False)):
            grown = MemoryReading(
                reading.mlx_active_bytes, slack + drift, reading.recent_peak_bytes, 1.0
            )
            assert (
                gate(
                    dims,
                    grown,
                    chunk_tokens=size,
                    num_cached_tokens=num_cached,
                    limits=limits,
                    others_in_flight=others,
                )
                is proceeds
            )


def test_lone_request_ignores_a_stale_recent_peak() -> None:
    dims, limits = _dims(), _limits(40 * GIB, 2 * GIB)
    # A measured peak so close to the limit that this chunk's KV on top breaches it.
    stale = MemoryReading(20 * GIB, 20 * GIB, recent_peak_bytes=40 * GIB - 32 * MIB, taken_at_s=5.0)
    assert gate(
        dims, stale, chunk_tokens=512, num_cached_tokens=0, limits=limits, others_in_flight=False
    )
    assert not gate(
        dims, stale, chunk_tokens=512, num_cached_tokens=0, limits=limits, others_in_flight=True
    )
    lone = estimate_prefill(
        dims,
        stale,
        num_new_tokens=512,
        num_cached_tokens=0,
        chunk_tokens=512,
        limits=limits,
        others_in_flight=False,
    )
    busy = estimate_prefill(
        dims,
        stale,
        num_new_tokens=512,
        num_cached_tokens=0,
        chunk_tokens=512,
        limits=limits,
        others_in_flight=True,
    )
    assert (lone.current_bytes, busy.current_bytes) == (20 * GIB, 40 * GIB - 32 * MIB)


# -- auto-profile arithmetic ----------------------------------------------------------------


def _capacity(limits: Limits, dims: ModelDims, **overrides: int) -> int:
    args = {
        "baseline_bytes": 8 * GIB,
        "chunk_tokens": 512,
        "overhead_bytes": 2 * GIB,
        "unmodeled_bytes": 0,
        "canary_bytes": 256 * MIB,
    } | overrides
    return kv_capacity_tokens(limits, dims, **args)


def _front_door_peak(limits: Limits, dims: ModelDims, tokens: int, unmodeled: int = 0) -> int:
    return estimate_prefill(
        dims,
        _reading(8 * GIB),
        num_new_tokens=tokens,
        num_cached_tokens=0,
        chunk_tokens=512,
        limits=limits,
        others_in_flight=False,
        unmodeled_bytes=unmodeled,
    ).peak_bytes


def test_kv_capacity_is_the_largest_prompt_the_front_door_passes() -> None:
    dims = _dims()  # 128 KiB of KV per token, fused attention
    limits = _limits(20 * GIB, margin=2 * GIB)
    tokens = _capacity(limits, dims)
    # The front door counts the prompt's KV twice (the cache's growth copy) and one
    # chunk's fused attention transient beside the model, margin and canary.
    attention = 512 * 32 * 128 * 4
    room = 20 * GIB - 8 * GIB - 2 * GIB - 256 * MIB - attention
    assert tokens == room // (2 * dims.kv_bytes_per_token)
    canary = 256 * MIB
    assert _front_door_peak(limits, dims, tokens) + canary <= limits.hard_bytes
    assert _front_door_peak(limits, dims, tokens + 1) + canary > limits.hard_bytes


def test_kv_capacity_never_contradicts_the_front_door() -> None:
    rng = random.Random(27)
    for _ in range(300):
        dims = _dims(rng.choice([64, 96, 128, 256]), heads=rng.choice([8, 32]))
        limits = _limits(rng.randint(2, 64) * GIB, margin=rng.randint(0, 2048) * MIB)
        unmodeled = rng.randint(0, 512) * MIB
        overhead = rng.randint(0, 4096) * MIB
        tokens = _capacity(
            limits, dims, overhead_bytes=overhead, unmodeled_bytes=unmodeled, canary_bytes=0
        )
        if tokens:
            assert _front_door_peak(limits, dims, tokens, unmodeled) <= limits.hard_bytes
            # Beside that KV the measured worst step (e.g. a decode batch) fits too.
            assert 8 * GIB + tokens * dims.kv_bytes_per_token + overhead <= limits.hard_bytes
        more = _front_door_peak(limits, dims, tokens + 1, unmodeled)
        step = 8 * GIB + (tokens + 1) * dims.kv_bytes_per_token + overhead
        assert max(more, step) > limits.hard_bytes


def test_the_measured_decode_step_bounds_capacity_when_it_is_the_worst() -> None:
    dims = _dims()
    limits = _limits(20 * GIB)
    prefill_bound = _capacity(limits, dims, overhead_bytes=0)
    decode_bound = _capacity(limits, dims, overhead_bytes=10 * GIB)
    assert decode_bound < prefill_bound
    assert 8 * GIB + decode_bound * dims.kv_bytes_per_token + 10 * GIB + 256 * MIB <= 20 * GIB


def test_the_batched_step_counts_only_as_many_rows_as_the_capacity_holds() -> None:
    """Eight rows of 2 GiB each would leave no room at all; but a batched step is no
    wider than the chunks of the KV in flight, so the capacity counts the rows its
    own tokens make, and is what that leaves."""
    dims, limits = _dims(), _limits(20 * GIB)
    batch = BatchTransient(row_bytes=2 * GIB, rows=8)
    assert _capacity(limits, dims, overhead_bytes=16 * GIB) == 0  # counted whole: no room
    tokens = _capacity(limits, dims, overhead_bytes=0, batch=batch)
    rows = math.ceil(tokens / 512)
    assert 1 <= rows < 8
    held = 8 * GIB + tokens * dims.kv_bytes_per_token + rows * 2 * GIB + 256 * MIB
    assert held <= 20 * GIB
    # One token more would fit no longer (its KV, or a row more).
    more = 8 * GIB + (tokens + 1) * dims.kv_bytes_per_token + batch.at(tokens + 1, 512)
    assert max(more, _front_door_peak(limits, dims, tokens + 1)) + 256 * MIB > 20 * GIB
    assert batch.at(1, 512) == 2 * GIB and batch.at(512 * 20, 512) == 16 * GIB


def test_each_retry_shrinks_capacity_by_five_percent() -> None:
    dims = _dims()
    sizes = [_capacity(_limits(40 * GIB), dims, attempt=a) for a in range(4)]
    for before, after in itertools.pairwise(sizes):
        assert after == pytest.approx(before * 0.95, abs=1)


def test_no_room_means_zero_capacity() -> None:
    dims = _dims()
    assert _capacity(_limits(8 * GIB + 100 * MIB), dims, overhead_bytes=0) == 0
    assert _capacity(_limits(20 * GIB, margin=12 * GIB), dims) == 0


# -- the transient margin -----------------------------------------------------------------


def test_auto_margin_is_the_measured_transient_times_the_factor_with_a_floor() -> None:
    assert measured_margin_bytes(132 * MIB) == math.ceil(1.25 * 132 * MIB)
    # Seed 000's worst MoE dequant step (10.6 GB) is covered with room to spare.
    assert measured_margin_bytes(10_600_000_000) >= 12 * 10**9
    assert measured_margin_bytes(0) == measured_margin_bytes(-MIB) == 64 * MIB
    assert measured_margin_bytes(MIB) == 64 * MIB


def test_auto_margin_replaces_the_unmodeled_term_a_pinned_one_adds_to_it() -> None:
    auto = resolve_limits("8GiB", total_ram_bytes=64 * GIB, transient_margin_bytes=None)
    assert not auto.margin_pinned and auto.transient_margin_bytes == GIB  # unmeasured default
    measured, extra = apply_measured_margin(
        auto, step_transient_bytes=400 * MIB, unmodeled_bytes=300 * MIB
    )
    # The measured step already holds the unmodeled part: counted once, with the factor.
    assert (measured.transient_margin_bytes, extra) == (500 * MIB, 0)
    assert (measured.hard_bytes, measured.soft_bytes) == (auto.hard_bytes, auto.soft_bytes)
    unmeasured, extra = apply_measured_margin(
        auto, step_transient_bytes=None, unmodeled_bytes=300 * MIB
    )
    assert (unmeasured, extra) == (auto, 300 * MIB)
    pinned = resolve_limits("8GiB", total_ram_bytes=64 * GIB, transient_margin_bytes=GIB)
    kept, extra = apply_measured_margin(
        pinned, step_transient_bytes=400 * MIB, unmodeled_bytes=300 * MIB
    )
    assert (kept, extra) == (pinned, 300 * MIB)


def test_auto_margin_serves_a_small_ceiling_the_fixed_one_refused() -> None:
    # The numbers: SmolLM2 (float32) resident 712 MB, measured step 132 MB.
    dims = ModelDims(30, 3, 64, 9, 576, kv_dtype_bytes=4)
    limits = resolve_limits(1_200_000_000, total_ram_bytes=16 * GIB, transient_margin_bytes=None)
    auto, extra = apply_measured_margin(
        limits, step_transient_bytes=132_000_000, unmodeled_bytes=107_000_000
    )
    args = {"num_new_tokens": 33, "num_cached_tokens": 0, "chunk_tokens": 512}
    est = preflight(dims, baseline_bytes=712_000_000, limits=auto, unmodeled_bytes=extra, **args)
    assert est.peak_bytes < limits.hard_bytes
    with pytest.raises(PrefillMemoryExceeded, match="transient margin fill"):
        preflight(
            dims, baseline_bytes=712_000_000, limits=limits, unmodeled_bytes=107_000_000, **args
        )


def test_canary_is_two_percent_of_the_limit_capped_at_256_mib() -> None:
    assert canary_bytes(_limits(1 * GIB)) == int(GIB * 0.02)
    assert canary_bytes(_limits(128 * GIB)) == 256 * MIB


def test_unmodeled_transient_is_what_the_formulas_miss() -> None:
    dims = _dims(head_dim=128)  # fused attention: a small modeled transient
    modeled = attention_transient_bytes(dims, chunk_tokens=512, num_context_tokens=512) + (
        dims.kv_bytes_per_token * 512
    )
    measured = modeled + 300 * MIB
    assert unmodeled_transient_bytes(dims, chunk_tokens=512, measured_bytes=measured) == 300 * MIB
    assert unmodeled_transient_bytes(dims, chunk_tokens=512, measured_bytes=modeled // 2) == 0


def test_unmodeled_bytes_raise_every_estimate() -> None:
    dims, reading, limits = _dims(), _reading(8 * GIB), _limits(100 * GIB)
    args = {"num_new_tokens": 1000, "num_cached_tokens": 0, "chunk_tokens": 512}
    plain = estimate_prefill(dims, reading, limits=limits, others_in_flight=False, **args)
    measured = estimate_prefill(
        dims, reading, limits=limits, others_in_flight=False, unmodeled_bytes=GIB, **args
    )
    assert measured.peak_bytes == plain.peak_bytes + GIB
    fits = gate(
        dims,
        reading,
        chunk_tokens=512,
        num_cached_tokens=0,
        limits=_limits(plain.peak_bytes),
        others_in_flight=False,
    )
    refused = gate(
        dims,
        reading,
        chunk_tokens=512,
        num_cached_tokens=0,
        limits=_limits(plain.peak_bytes),
        others_in_flight=False,
        unmodeled_bytes=GIB,
    )
    assert fits and not refused


def test_a_rank_of_a_split_model_prices_its_own_share() -> None:
    dims = ModelDims(
        num_layers=30, num_kv_heads=4, head_dim=64, num_attention_heads=8, hidden_size=512
    )
    tensor = rank_share(dims, "tensor", 2)
    assert (tensor.num_kv_heads, tensor.num_attention_heads, tensor.num_layers) == (2, 4, 30)
    assert tensor.kv_bytes_per_token * 2 == dims.kv_bytes_per_token
    # 31 layers over 2 ranks: the busiest rank holds 16 of them.
    assert rank_share(dataclasses.replace(dims, num_layers=31), "pipeline", 2).num_layers == 16
    assert rank_share(dims, "pipeline", 1) == dims == rank_share(dims, None, 2)
