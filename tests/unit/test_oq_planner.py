"""The oQ planner: budgets, protection, levels. Pure: synthetic sensitivities."""

from __future__ import annotations

import pytest

from omlx.errors import InvalidRequestError
from omlx.quant.levels import LEVELS, bits_cost, check_group_size, get_level
from omlx.quant.planner import LayerStats, plan_bits

BITS = (2, 3, 4, 5, 6, 8)


def _errors(scale: float) -> dict[int, float]:
    # Quantization noise power falls ~4x per extra bit.
    return {b: scale * 4.0**-b for b in BITS}


def _model(num_layers: int = 12) -> list[LayerStats]:
    """A small transformer-shaped model: embedding, per-layer attention and MLP, head."""
    layers = [LayerStats("model.embed_tokens", 2_000 * 64, _errors(0.5), "embedding")]
    for i in range(num_layers):
        layers += [
            LayerStats(f"model.layers.{i}.self_attn.q_proj", 64 * 64, _errors(1.0 + i % 3)),
            LayerStats(f"model.layers.{i}.self_attn.v_proj", 64 * 32, _errors(2.0)),
            LayerStats(f"model.layers.{i}.mlp.up_proj", 64 * 256, _errors(0.8 + 0.1 * i)),
            LayerStats(f"model.layers.{i}.mlp.down_proj", 256 * 64, _errors(1.5)),
        ]
    layers.append(LayerStats("lm_head", 2_000 * 64, _errors(0.5), "lm_head"))
    return layers


def _stored_bpw(layers: list[LayerStats], bits: dict[str, int], group_size: int, scale: int):
    total = sum(x.num_params for x in layers)
    return sum(bits_cost(bits[x.path], group_size, scale) * x.num_params for x in layers) / total


@pytest.mark.parametrize("name", list(LEVELS))
@pytest.mark.parametrize(("group_size", "scale_bits"), [(64, 16), (32, 16), (64, 32)])
def test_plan_meets_the_level_target(name: str, group_size: int, scale_bits: int) -> None:
    layers = _model()
    level = get_level(name)
    plan = plan_bits(layers, level, group_size, scale_bits)
    bpw = _stored_bpw(layers, plan.bits, group_size, scale_bits)
    target = level.target_bits + 2 * scale_bits / group_size
    assert plan.target_bits_per_weight == pytest.approx(target)
    assert plan.bits_per_weight == pytest.approx(bpw)
    assert bpw <= target + 1e-9
    # The budget is spent, not left on the table (the smallest layer is 2,048 weights).
    assert bpw >= target - 0.25
    assert set(plan.bits) == {x.path for x in layers}
    assert set(plan.bits.values()) <= set(level.candidate_bits)


def test_uniform_b_bit_is_the_target_at_equal_size() -> None:
    # oQ3..oQ8 spend exactly what the uniform b-bit model stores, scales included.
    for name, bits in [("oQ3", 3), ("oQ4", 4), ("oQ6", 6), ("oQ8", 8)]:
        assert get_level(name).target_bits_per_weight(64, 16) == bits_cost(bits, 64, 16)
    assert bits_cost(4, 64, 16) == 4.5
    assert bits_cost(4, 64, 32) == 5.0  # float32 scale and bias per group of 64


def test_embeddings_and_head_never_drop_below_the_base_width() -> None:
    layers = _model()
    # Make them look robust: without protection they are the cheapest to cut.
    for i in (0, -1):
        x = layers[i]
        layers[i] = LayerStats(x.path, x.num_params, _errors(1e-6), x.role)
    plan = plan_bits(layers, get_level("oQ4"), 64)
    assert plan.bits["model.embed_tokens"] >= 4
    assert plan.bits["lm_head"] >= 4
    assert {"model.embed_tokens", "lm_head"} <= set(plan.protected)
    # The same robust layers as plain linears are cut below the base.
    unprotected = [LayerStats(x.path, x.num_params, x.errors) for x in layers]
    cut = plan_bits(unprotected, get_level("oQ4"), 64)
    assert cut.bits["model.embed_tokens"] == 3


def test_most_sensitive_layers_keep_more_bits() -> None:
    layers = _model()
    hot = "model.layers.5.mlp.up_proj"
    layers = [
        LayerStats(x.path, x.num_params, _errors(500.0) if x.path == hot else x.errors, x.role)
        for x in layers
    ]
    plan = plan_bits(layers, get_level("oQ4"), 64)
    assert hot in plan.protected
    assert plan.bits[hot] >= 5
    same_shape = [x.path for x in layers if x.path.endswith("up_proj") and x.path != hot]
    assert all(plan.bits[hot] > plan.bits[p] for p in same_shape)
    # Some robust layers pay for it by going below the base width.
    assert min(plan.bits.values()) == 3


def test_higher_levels_spend_more_bits() -> None:
    layers = _model()
    averages = [plan_bits(layers, level, 64).bits_per_weight for level in LEVELS.values()]
    assert averages == sorted(averages)
    assert len(set(averages)) == len(averages)


def test_histogram_counts_layers_per_width() -> None:
    layers = _model(4)
    plan = plan_bits(layers, get_level("oQ4"), 64)
    histogram = plan.histogram()
    assert sum(histogram.values()) == len(layers)
    assert all(isinstance(k, str) and int(k) in BITS for k in histogram)


def test_unknown_level_names_the_valid_ones() -> None:
    with pytest.raises(InvalidRequestError) as err:
        get_level("oQ7")
    assert err.value.http_status == 400
    assert err.value.param == "level"
    for name in ("oQ2", "oQ3", "oQ4", "oQ6", "oQ8"):
        assert name in err.value.message


def test_bad_group_size_is_refused() -> None:
    assert check_group_size(64) == 64
    with pytest.raises(InvalidRequestError, match="group_size"):
        check_group_size(48)


def test_missing_measurement_and_empty_model_are_errors() -> None:
    partial = [LayerStats("a", 4096, {4: 0.1})]
    with pytest.raises(ValueError, match="no measurement"):
        plan_bits(partial, get_level("oQ4"), 64)
    with pytest.raises(InvalidRequestError):
        plan_bits([], get_level("oQ4"), 64)
