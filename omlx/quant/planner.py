"""Bits per layer from measured sensitivity. Pure: no mlx import.

``plan_bits`` minimizes the parameter-weighted sum of relative output errors
(the mean error per weight) within the level's budget of stored bits: every
layer starts at the level's lowest width, fragile ones (embeddings, lm_head,
the most sensitive layers) at the base width, and the upgrade with the largest
error drop per stored bit is bought until the budget is spent. Errors fall
about 4x per extra bit, so this greedy knapsack is close to optimal.

Why weighted, and why the floor is the base width, measured on SmolLM2 (see
benchmarks/README.md): unweighted errors starve the large MLP layers, and
raising the tied embedding above the base paid for with narrower layers both
lost to uniform quantization at equal size.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from omlx.errors import InvalidRequestError
from omlx.quant.levels import DEFAULT_SCALE_BITS, Level, bits_cost

# Roles whose errors reach every token directly (input lookup, output logits).
PROTECTED_ROLES = frozenset({"embedding", "lm_head"})
# Share of the other layers, by error at the base width, that keep the base width too.
SENSITIVE_FRACTION = 0.05


@dataclass(frozen=True, slots=True)
class LayerStats:
    """One quantizable layer: ``errors`` maps bits -> relative output error
    (||y - y_q||^2 / ||y||^2 on calibration inputs)."""

    path: str
    num_params: int
    errors: Mapping[int, float]
    role: str = "linear"  # "embedding", "lm_head" or "linear"


@dataclass(frozen=True, slots=True)
class Plan:
    bits: dict[str, int]
    group_size: int
    target_bits_per_weight: float
    bits_per_weight: float
    protected: tuple[str, ...]

    def histogram(self) -> dict[str, int]:
        """Number of layers at each width, keyed by the width as a string (JSON-ready)."""
        counts = Counter(self.bits.values())
        return {str(b): counts[b] for b in sorted(counts)}


def plan_bits(
    layers: Sequence[LayerStats],
    level: Level,
    group_size: int,
    scale_bits: int = DEFAULT_SCALE_BITS,
) -> Plan:
    """Pick bits per layer so the average stored bits per weight stays within the
    level's target at ``group_size`` (scale and bias overhead counted)."""
    if not layers:
        raise InvalidRequestError("the model has no layers that can be quantized")
    candidates = level.candidate_bits
    for layer in layers:
        missing = [b for b in candidates if b not in layer.errors]
        if missing or layer.num_params <= 0:
            raise ValueError(f"{layer.path}: no measurement for bits {missing}")
    total = sum(layer.num_params for layer in layers)
    budget = level.target_bits_per_weight(group_size, scale_bits) * total

    def cost(bits: dict[str, int]) -> float:
        return sum(bits_cost(bits[x.path], group_size, scale_bits) * x.num_params for x in layers)

    # Sums of floats: a layer that fits exactly must not miss by a rounding error.
    budget *= 1 + 1e-12
    bits, protected = _floors(layers, level, budget, cost)
    _greedy_upgrade(layers, bits, candidates, budget - cost(bits), group_size, scale_bits)
    return Plan(
        bits=bits,
        group_size=group_size,
        target_bits_per_weight=level.target_bits_per_weight(group_size, scale_bits),
        bits_per_weight=cost(bits) / total,
        protected=tuple(protected),
    )


def _floors(
    layers: Sequence[LayerStats],
    level: Level,
    budget: float,
    cost: Callable[[dict[str, int]], float],
) -> tuple[dict[str, int], list[str]]:
    """Starting widths: the lowest candidate; embeddings / lm_head and the most
    sensitive layers never below the base width (sensitive floors dropped first
    when the budget cannot hold them)."""
    low, floor = level.candidate_bits[0], level.base_bits
    fragile = [x.path for x in layers if x.role in PROTECTED_ROLES]
    others = [x for x in layers if x.role not in PROTECTED_ROLES]
    num_sensitive = math.ceil(SENSITIVE_FRACTION * len(others)) if others else 0
    ranked = sorted(others, key=lambda x: x.errors[level.base_bits], reverse=True)
    sensitive = [x.path for x in ranked[:num_sensitive]]
    for raised in (fragile + sensitive, fragile, []):
        bits = {x.path: low for x in layers}
        bits.update(dict.fromkeys(raised, floor))
        if cost(bits) <= budget:
            return bits, raised
    return {x.path: low for x in layers}, []


def _greedy_upgrade(
    layers: Sequence[LayerStats],
    bits: dict[str, int],
    candidates: tuple[int, ...],
    remaining: float,
    group_size: int,
    scale_bits: int,
) -> None:
    """Spend ``remaining`` stored bits on the upgrades with the best error drop per bit."""
    while True:
        best: tuple[float, LayerStats, int, float] | None = None
        for layer in layers:
            current = bits[layer.path]
            for higher in (b for b in candidates if b > current):
                extra = (
                    bits_cost(higher, group_size, scale_bits)
                    - bits_cost(current, group_size, scale_bits)
                ) * layer.num_params
                if extra > remaining:
                    continue
                # Error drop of the parameter-weighted sum, per stored bit.
                gain = (layer.errors[current] - layer.errors[higher]) * layer.num_params / extra
                if best is None or gain > best[0]:
                    best = (gain, layer, higher, extra)
        if best is None or best[0] <= 0:
            return
        _, layer, higher, extra = best
        bits[layer.path] = higher
        remaining -= extra
