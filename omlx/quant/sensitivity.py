"""Per-layer sensitivity: the relative output error of each quantizable layer at
each candidate width, measured on calibration tokens through the float model.

Each Linear / Embedding is swapped for a probe that runs the float layer and, on
a subsample of its input rows, compares the output with the output of the same
inputs through the quantized-then-dequantized weight. Inputs are never stored:
errors are reduced to two sums per width on the spot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from omlx.mlx_types import int_list, item_float
from omlx.quant.planner import LayerStats

# Output elements per call used for the error sums (rows x output width): enough
# for a stable ratio, and it keeps the vocab-wide lm_head cheap.
MAX_ELEMENTS = 1 << 22
MAX_ROWS = 256
# Distinct token ids whose embedding rows are compared for the lookup error.
MAX_LOOKUP_IDS = 4096


class QuantCancelled(Exception):
    """The caller's cancel check said stop."""


@dataclass(slots=True)
class _Sums:
    """Per use of a layer (lookup, linear): sum ||y - y_q||^2 and sum ||y||^2 per width."""

    error: dict[int, float] = field(default_factory=dict)
    signal: float = 0.0

    def add(self, signal: mx.array, errors: dict[int, mx.array]) -> None:
        mx.eval(signal, *errors.values())
        self.signal += item_float(signal)
        for bits, value in errors.items():
            self.error[bits] = self.error.get(bits, 0.0) + item_float(value)

    def relative(self) -> dict[int, float]:
        return {b: e / max(self.signal, 1e-30) for b, e in self.error.items()}


def qdq(weight: mx.array, bits: int, group_size: int) -> mx.array:
    """``weight`` after an affine quantize / dequantize round trip."""
    q, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return mx.dequantize(q, scales, biases, group_size=group_size, bits=bits)


def _rows(x: mx.array, out_width: int) -> mx.array:
    flat = x.reshape(-1, x.shape[-1])
    limit = max(16, min(MAX_ROWS, MAX_ELEMENTS // out_width))
    step = max(1, flat.shape[0] // limit)
    return flat[::step][:limit]


class _Probe(nn.Module):
    """Stands in for one layer during measurement; forwards every call to it."""

    def __init__(
        self, inner: nn.Module, bits: Sequence[int], group_size: int, tick: Callable[[], None]
    ):
        super().__init__()
        self.inner = inner
        self._bits = tuple(bits)
        self._group_size = group_size
        self._tick = tick
        self._ids: set[int] = set()
        self.sums: dict[str, _Sums] = {}

    def _measure_linear(self, x: mx.array) -> None:
        weight = self.inner.weight
        rows = _rows(x, weight.shape[0])
        errors = {}
        for bits in self._bits:
            diff = rows @ (qdq(weight, bits, self._group_size) - weight).T
            errors[bits] = (diff.astype(mx.float32) ** 2).sum()
            mx.eval(errors[bits])  # frees this width's dequantized copy before the next
        signal = ((rows @ weight.T).astype(mx.float32) ** 2).sum()
        self.sums.setdefault("linear", _Sums()).add(signal, errors)

    def _measure_lookup(self) -> None:
        # Groups run along rows, so quantizing only the looked-up rows is exact.
        ids = sorted(self._ids)[:: max(1, len(self._ids) // MAX_LOOKUP_IDS)]
        rows = self.inner.weight[mx.array(ids)]
        errors = {
            b: ((qdq(rows, b, self._group_size) - rows).astype(mx.float32) ** 2).sum()
            for b in self._bits
        }
        self.sums["lookup"] = _Sums()
        self.sums["lookup"].add((rows.astype(mx.float32) ** 2).sum(), errors)

    def __call__(self, x: mx.array) -> mx.array:
        if isinstance(self.inner, nn.Embedding):
            self._ids.update(int_list(x.reshape(-1)))
        else:
            self._measure_linear(x)
        self._tick()
        out: mx.array = self.inner(x)  # an nn.Module call: unannotated in mlx
        return out

    def as_linear(self, x: mx.array) -> mx.array:
        # Tied embeddings double as the output head.
        self._measure_linear(x)
        out: mx.array = self.inner.as_linear(x)
        return out

    def relative_errors(self) -> dict[int, float] | None:
        """The worse of the layer's uses (a tied embedding is a lookup and the head);
        None when the forward pass never used the layer."""
        if self._ids:
            self._measure_lookup()
        if not self.sums:
            return None
        per_use = [s.relative() for s in self.sums.values()]
        return {b: max(u[b] for u in per_use) for b in self._bits}


def quantizable_layers(model: nn.Module, group_size: int) -> dict[str, nn.Module]:
    """Float Linear / Embedding layers whose input width splits into groups."""
    # tree_flatten returns a list here (no ``destination``); mlx types it list-or-dict.
    leaves = cast(
        "list[tuple[str, nn.Module]]",
        tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module),
    )
    return {
        path: m
        for path, m in leaves
        if type(m) in (nn.Linear, nn.Embedding) and m.weight.shape[-1] % group_size == 0
    }


def layer_role(path: str, module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "lm_head" if path.split(".")[-1] in ("lm_head", "output") else "linear"


def measure_sensitivity(
    model: nn.Module,
    chunks: Sequence[mx.array],
    bits: Sequence[int],
    group_size: int,
    on_progress: Callable[[float], None] = lambda _f: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[LayerStats]:
    """Run ``chunks`` (token-id arrays of shape (1, n)) through ``model`` with every
    quantizable layer probed; the model is restored before returning or raising."""
    layers = quantizable_layers(model, group_size)
    calls = 0
    expected = max(1, len(layers) * len(chunks))

    def tick() -> None:
        nonlocal calls
        calls += 1
        on_progress(min(1.0, calls / expected))
        if should_stop():
            raise QuantCancelled

    probes = {p: _Probe(m, bits, group_size, tick) for p, m in layers.items()}
    model.update_modules(tree_unflatten(list(probes.items())))
    try:
        for tokens in chunks:
            mx.eval(model(tokens))
    finally:
        model.update_modules(tree_unflatten(list(layers.items())))
    stats = []
    for path, probe in probes.items():
        errors = probe.relative_errors()
        stats.append(
            LayerStats(
                path=path,
                num_params=int(layers[path].weight.size),
                # A layer the forward pass never used costs nothing to quantize hard.
                errors=errors if errors is not None else dict.fromkeys(bits, 0.0),
                role=layer_role(path, layers[path]),
            )
        )
    return stats
