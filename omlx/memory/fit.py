"""Will a model fit? Its weights, the KV of its context at the configured
concurrency and the prefill transient, against ``memory.max_process_memory``.

Pure: no MLX. The numbers are the guard's own (``budget.held_tokens_peak_bytes``
and ``budget.kv_capacity_tokens``): "fits" means the auto-profile will give the
model room for every concurrent request at its full context, so a download's
verdict and the served model's behaviour agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import psutil

from omlx.memory.budget import (
    NO_DEVICE_CAP,
    DeviceCap,
    Limits,
    ModelDims,
    apply_measured_margin,
    attention_transient_bytes,
    canary_bytes,
    held_tokens_peak_bytes,
    kv_capacity_tokens,
    prefill_step_transient_bytes,
    resolve_limits,
)
from omlx.memory.dims import (
    conservative_dims,
    gated_delta_state_bytes,
    kv_quantized_start,
    model_dims,
    quantized_kv_dims,
)
from omlx.settings import Settings
from omlx.sizes import format_bytes

__all__ = ["FitEstimate", "estimate_fit", "fit_for_settings", "native_context_tokens"]

Verdict = Literal["fits", "fits_shorter_context", "does_not_fit"]

# A config naming no context length: the default generation.max_context_window.
DEFAULT_CONTEXT_TOKENS = 32768
# A config naming no dtype: float32 activations, the widest MLX runs (over-estimates KV).
DEFAULT_KV_DTYPE_BYTES = 4
# Below this per-request context a chat model is of no use: the verdict is "does not fit".
MIN_USEFUL_CONTEXT_TOKENS = 256
DEFAULT_CHUNK_TOKENS = 512  # scheduler.prefill_step_size's default

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_LM_SUBCONFIGS = ("text_config", "language_config", "llm_config")
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


@dataclass(frozen=True)
class FitEstimate:
    """The verdict and the numbers behind it (bytes; tokens per request)."""

    verdict: Verdict
    weights_bytes: int
    kv_bytes: int  # the requests' fixed states (state_bytes) included
    transient_bytes: int
    total_bytes: int
    limit_bytes: int
    context_tokens: int
    # The largest context that fits at this concurrency (rounded down); None: none does.
    max_context_tokens: int | None
    concurrency: int
    # What the process already holds (runtime, other models), counted in total_bytes.
    baseline_bytes: int = 0
    # Assumptions made for fields the config lacks.
    notes: tuple[str, ...] = ()
    # Of kv_bytes, the fixed states every request holds (a gated-delta hybrid's).
    state_bytes: int = 0

    @property
    def message(self) -> str:
        if self.verdict == "fits":
            return "fits"
        if self.verdict == "fits_shorter_context":
            return f"fits with a shorter context: {self.max_context_tokens} tokens"
        return (
            f"does not fit: needs {format_bytes(self.total_bytes)}, "
            f"limit {format_bytes(self.limit_bytes)}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "message": self.message,
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "state_bytes": self.state_bytes,
            "transient_bytes": self.transient_bytes,
            "total_bytes": self.total_bytes,
            "limit_bytes": self.limit_bytes,
            "context_tokens": self.context_tokens,
            "max_context_tokens": self.max_context_tokens,
            "concurrency": self.concurrency,
            "baseline_bytes": self.baseline_bytes,
            "notes": list(self.notes),
        }


def estimate_fit(
    config: Mapping[str, Any],
    weights_bytes: int,
    *,
    limit_bytes: int,
    concurrency: int,
    baseline_bytes: int = 0,
    context_tokens: int | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    transient_margin_bytes: int | None = None,
    kv_quant: tuple[int, int, int] | None = None,
) -> FitEstimate:
    """The fit of a model (its config.json dict and weight bytes) under ``limit_bytes``.

    ``context_tokens`` None: the config's own context length. ``transient_margin_bytes``
    None is the "auto" margin: the estimated step transient x1.25, as the guard
    derives it from the measured one. ``kv_quant``: (bits, group size, quantized_kv_start)
    of a quantized KV cache (the model's kv_bits). Raises ValueError naming a bad argument.
    """
    _check_args(weights_bytes, limit_bytes, concurrency, baseline_bytes, context_tokens)
    notes: list[str] = []
    dims = _dims(config, notes)
    if kv_quant is not None:
        bits, group_size, start = kv_quant
        full = dims.kv_bytes_per_token
        dims = quantized_kv_dims(dims, bits, group_size)
        dims = kv_quantized_start(dims, full, start, rows=concurrency, chunk_tokens=chunk_tokens)
        after = f" after {start} tokens (its quantized_kv_start)" if start else ""
        notes.append(f"KV cache quantized to {bits} bits{after} (the model's kv_bits)")
    if context_tokens is None:
        context_tokens = native_context_tokens(config) or _assumed_context(notes)
    limits = _limits(limit_bytes, transient_margin_bytes, dims, chunk_tokens)
    resident = baseline_bytes + weights_bytes
    tokens = context_tokens * concurrency
    # Each request's fixed states (a hybrid's), in KV tokens as the guard's capacity counts them.
    held = tokens + concurrency * dims.state_tokens_per_sequence
    total = _peak_bytes(limits, dims, held, resident, chunk_tokens)
    kv = dims.kv_bytes(tokens) + dims.state_bytes(concurrency)
    verdict: Verdict = "fits"
    fitting: int | None = context_tokens
    if total > limit_bytes:
        fitting = _largest_context(limits, dims, resident, chunk_tokens, concurrency)
        verdict = "fits_shorter_context" if fitting is not None else "does_not_fit"
    return FitEstimate(
        verdict=verdict,
        weights_bytes=weights_bytes,
        kv_bytes=kv,
        transient_bytes=total - resident - kv,
        total_bytes=total,
        limit_bytes=limit_bytes,
        context_tokens=context_tokens,
        max_context_tokens=fitting,
        concurrency=concurrency,
        baseline_bytes=baseline_bytes,
        notes=tuple(notes),
        state_bytes=dims.state_bytes(concurrency),
    )


def fit_for_settings(
    config: Mapping[str, Any],
    weights_bytes: int,
    settings: Settings,
    *,
    baseline_bytes: int = 0,
    context_tokens: int | None = None,
    total_ram_bytes: int | None = None,
    device_cap: DeviceCap = NO_DEVICE_CAP,
    kv_quant: tuple[int, int, int] | None = None,
) -> FitEstimate:
    """``estimate_fit`` under the settings: the limit resolved as the guard resolves
    it (under the running server's ``device_cap``), scheduler.max_concurrent_requests,
    prefill_step_size, and the context window the server would give the model (its
    own, capped by generation.max_context_window). ``baseline_bytes``: the running server's
    live idle baseline (0 without one). Raises SettingsError for a bad limit."""
    from omlx.memory.guard import memory_limits

    # psutil's total, as memory/probe.py reads it (its import drags in the MLX counters).
    ram = total_ram_bytes if total_ram_bytes is not None else psutil.virtual_memory().total
    limits = memory_limits(settings.memory, ram, device_cap)
    native = native_context_tokens(config)
    window = settings.generation.max_context_window
    if context_tokens is None:
        context_tokens = window if native is None else min(window, native)
    estimate = estimate_fit(
        config,
        weights_bytes,
        limit_bytes=limits.hard_bytes,
        concurrency=settings.scheduler.max_concurrent_requests,
        baseline_bytes=baseline_bytes,
        context_tokens=context_tokens,
        chunk_tokens=settings.scheduler.prefill_step_size,
        transient_margin_bytes=limits.transient_margin_bytes if limits.margin_pinned else None,
        kv_quant=kv_quant,
    )
    if native is None:
        note = f"the config names no context length: assumed {context_tokens} tokens"
        estimate = replace(estimate, notes=(*estimate.notes, note))
    return estimate


def native_context_tokens(config: Mapping[str, Any]) -> int | None:
    """The model's own context length from its config (a nested LM config counts), or None."""
    for section in (config, *_sub_configs(config)):
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _check_args(
    weights: int, limit: int, concurrency: int, baseline: int, context: int | None
) -> None:
    if weights < 0 or baseline < 0:
        raise ValueError("weights_bytes and baseline_bytes must not be negative")
    if limit <= 0:
        raise ValueError(f"limit_bytes must be positive, got {limit}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if context is not None and context < 1:
        raise ValueError(f"context_tokens must be at least 1, got {context}")


def _sub_configs(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [config[k] for k in _LM_SUBCONFIGS if isinstance(config.get(k), Mapping)]


def _kv_dtype_bytes(config: Mapping[str, Any]) -> int | None:
    """Bytes per KV element from the config's dtype (mlx-lm writes torch_dtype or dtype)."""
    for section in (*_sub_configs(config), config):
        for key in ("torch_dtype", "dtype"):
            value = section.get(key)
            if isinstance(value, str) and value.lower() in _DTYPE_BYTES:
                return _DTYPE_BYTES[value.lower()]
    return None


def _dims(config: Mapping[str, Any], notes: list[str]) -> ModelDims:
    dtype_bytes = _kv_dtype_bytes(config)
    if dtype_bytes is None:
        dtype_bytes = DEFAULT_KV_DTYPE_BYTES
        notes.append("the config names no dtype: assumed float32 KV (4 bytes per value)")
    dims = model_dims(config, kv_dtype_bytes=dtype_bytes)
    if dims is None:
        dims = conservative_dims(config, kv_dtype_bytes=dtype_bytes)
        notes.append(
            "the config lacks layer or head counts: assumed a 70B-class shape "
            f"({dims.num_layers} layers, {dims.num_kv_heads} KV heads of {dims.head_dim}), "
            "which over-estimates a small model"
        )
    states = gated_delta_state_bytes(config, kv_dtype_bytes=dtype_bytes)
    if states:
        notes.append(f"each request holds {format_bytes(states)} of linear layers' state")
    return replace(dims, state_bytes_per_sequence=states)


def _assumed_context(notes: list[str]) -> int:
    notes.append(f"the config names no context length: assumed {DEFAULT_CONTEXT_TOKENS} tokens")
    return DEFAULT_CONTEXT_TOKENS


def _limits(limit: int, margin: int | None, dims: ModelDims, chunk_tokens: int) -> Limits:
    """The guard's limits; an "auto" margin from the estimated step transient, as the
    guard derives it from the measured one once the model has loaded."""
    limits = resolve_limits(limit, total_ram_bytes=limit, transient_margin_bytes=margin)
    step = attention_transient_bytes(
        dims, chunk_tokens=chunk_tokens, num_context_tokens=chunk_tokens
    ) + prefill_step_transient_bytes(dims, chunk_tokens, 0)
    limits, _ = apply_measured_margin(limits, step_transient_bytes=step, unmodeled_bytes=0)
    return limits


def _peak_bytes(limits: Limits, dims: ModelDims, tokens: int, resident: int, chunk: int) -> int:
    """The guard's peak for ``tokens`` of KV held, plus the canary it keeps free."""
    peak = held_tokens_peak_bytes(
        limits,
        dims,
        tokens=tokens,
        baseline_bytes=resident,
        chunk_tokens=chunk,
        overhead_bytes=0,
        unmodeled_bytes=0,
    )
    return peak + canary_bytes(limits)


def _largest_context(
    limits: Limits, dims: ModelDims, resident: int, chunk: int, concurrency: int
) -> int | None:
    """The per-request context the guard's KV capacity allows, rounded down; None below
    a useful size."""
    capacity = kv_capacity_tokens(
        limits,
        dims,
        baseline_bytes=resident,
        chunk_tokens=chunk,
        overhead_bytes=0,
        unmodeled_bytes=0,
        canary_bytes=canary_bytes(limits),
    )
    context = _round_down_tokens(capacity // concurrency - dims.state_tokens_per_sequence)
    return context if context >= MIN_USEFUL_CONTEXT_TOKENS else None


def _round_down_tokens(tokens: int) -> int:
    """Whole 256-token blocks (the prefix cache's block) from 2048 up; 64s below."""
    step = 256 if tokens >= 2048 else 64
    return tokens - tokens % step
