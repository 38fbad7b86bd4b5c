"""KV-capacity auto-profile at model load (seed 002): measure instead of guess.

MLX thread only. Two stress passes run on the freshly loaded model: one full
prefill chunk (the largest step one request takes) and one decode step of a
full batch. Their measured peaks give the step transient beyond the model's
resident bytes and, under ``prefill_transient_margin: auto``, the model's margin
(x1.25, floored); the KV tokens whose front-door estimate fits beside a safety
canary under the hard limit become the model's ``max_kv_tokens``. A validation pass holds the
canary and re-runs the worst stress: if the transient grew past what the
canary absorbs (or MLX fails to allocate), capacity shrinks 5% and the pass
repeats, at most 3 times, then the load fails naming every knob. An explicit
``max_kv_tokens`` skips the measurement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.errors import InsufficientMemoryError
from omlx.memory.budget import (
    PROFILE_MAX_RETRIES,
    KVProfile,
    Limits,
    ModelDims,
    apply_measured_margin,
    canary_bytes,
    kv_capacity_tokens,
    unmodeled_transient_bytes,
)
from omlx.memory.probe import MemoryProbe
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)

# Context each decode-stress sequence holds before its measured step.
DECODE_CONTEXT_TOKENS = 32


def auto_profile(
    model: Any,
    dims: ModelDims,
    probe: MemoryProbe,
    limits: Limits,
    *,
    chunk_tokens: int,
    batch_size: int,
    vocab_size: int,
    explicit_tokens: int | None = None,
) -> KVProfile:
    """Measure the model's step transients and choose its KV capacity.

    Raises InsufficientMemoryError (507) when not even one prefill chunk fits.
    """
    baseline = probe.reading(fresh=True).resident_bytes
    if explicit_tokens is not None:
        # Nothing measured: the margin is the pinned size or the unmeasured default.
        return KVProfile(
            explicit_tokens, "explicit", baseline, margin_bytes=limits.transient_margin_bytes
        )
    started = time.monotonic()
    stress = _Stress(model, vocab_size, chunk_tokens, batch_size)
    kv = dims.kv_bytes_per_token
    prefill = _Pass(stress.prefill, kv * chunk_tokens)
    decode = _Pass(stress.decode_step, kv * batch_size, prepare=stress.decode_context)
    prefill_peak, decode_peak = _measure(probe, prefill), _measure(probe, decode)
    overs = (prefill_peak - prefill.kv_bytes, decode_peak - decode.kv_bytes)
    if min(overs) < 0:
        log.warning("memprofile: a stress pass measured less than its own KV; clamped to 0")
    overhead = max(*overs, 0)
    worst = prefill if overs[0] >= overs[1] else decode
    canary = canary_bytes(limits)
    unmodeled = unmodeled_transient_bytes(
        dims, chunk_tokens=chunk_tokens, measured_bytes=max(overs[0], 0)
    )
    validated = 0
    for attempt in range(PROFILE_MAX_RETRIES + 1):
        # The margin follows the measured transient (when "auto"), as the guard's will.
        model_limits, extra = apply_measured_margin(
            limits, step_transient_bytes=overhead, unmodeled_bytes=unmodeled
        )
        tokens = kv_capacity_tokens(
            model_limits,
            dims,
            baseline_bytes=baseline,
            chunk_tokens=chunk_tokens,
            overhead_bytes=overhead,
            unmodeled_bytes=extra,
            canary_bytes=canary,
            attempt=attempt,
        )
        if tokens < chunk_tokens:
            break  # shrinking cannot help
        validated = attempt + 1
        measured = _validate(probe, worst, canary)
        if measured is not None:
            over = measured - canary - worst.kv_bytes
            # The canary absorbs jitter; more than that means the measurement was low.
            if over <= overhead + canary:
                return KVProfile(
                    max_kv_tokens=tokens,
                    source="measured",
                    baseline_bytes=baseline,
                    prefill_peak_bytes=prefill_peak,
                    decode_peak_bytes=decode_peak,
                    overhead_bytes=overhead,
                    unmodeled_bytes=unmodeled,
                    margin_bytes=model_limits.transient_margin_bytes,
                    canary_bytes=canary,
                    attempts=attempt + 1,
                    seconds=time.monotonic() - started,
                )
            overhead = max(overhead, over)
        log.warning("memprofile: validation attempt %d failed; shrinking 5%%", attempt + 1)
    failed, _ = apply_measured_margin(limits, step_transient_bytes=overhead, unmodeled_bytes=0)
    raise _failure(dims, failed, baseline, overhead, canary, chunk_tokens, validated)


@dataclass(frozen=True)
class _Pass:
    run: Callable[..., None]
    # KV the pass itself adds (counted by capacity, not as transient).
    kv_bytes: int
    # Built before the measurement starts; its memory counts as resident.
    prepare: Callable[[], Any] | None = None


class _Stress:
    """The stress passes, on token ids spread over the vocabulary."""

    def __init__(self, model: Any, vocab_size: int, chunk_tokens: int, batch_size: int):
        self._model = model
        self._vocab = max(2, vocab_size)
        self._chunk = chunk_tokens
        self._batch = batch_size

    def _tokens(self, rows: int, length: int) -> mx.array:
        ids = mx.arange(rows * length).reshape(rows, length) * 7919 % (self._vocab - 1) + 1
        return ids.astype(mx.int32)

    def prefill(self) -> None:
        """One full prefill chunk, as the runner evaluates it (cache state + last logits)."""
        cache = make_prompt_cache(self._model)
        logits = self._model(self._tokens(1, self._chunk), cache=cache)
        mx.eval(logits[:, -1, :], [c.state for c in cache])

    def decode_context(self) -> list[Any]:
        cache = make_prompt_cache(self._model)
        context = self._tokens(self._batch, DECODE_CONTEXT_TOKENS)
        mx.eval([c.state for c in cache], self._model(context, cache=cache)[:, -1, :])
        return cache

    def decode_step(self, cache: list[Any]) -> None:
        """One decode step of a full batch."""
        logits = self._model(self._tokens(self._batch, 1), cache=cache)
        mx.eval(logits, [c.state for c in cache])


def _measure(probe: MemoryProbe, stress: _Pass, canary: int = 0) -> int:
    """Bytes the pass (and the canary, if any) added at its peak over what was
    resident before it."""
    mx.clear_cache()
    held: list[mx.array] = []
    try:
        state = stress.prepare() if stress.prepare is not None else None

        def run() -> None:
            if canary:
                held.append(mx.zeros((max(1, canary // 4),), dtype=mx.float32))
                mx.eval(held)
            if state is None:
                stress.run()
            else:
                stress.run(state)

        return _peak_delta(probe, run)
    finally:
        held.clear()
        mx.clear_cache()


def _peak_delta(probe: MemoryProbe, run: Callable[[], None]) -> int:
    # MLX's peak covers device allocations; the footprint covers the rest (on
    # the CPU backend MLX memory is part of it, so take whichever grew more).
    start = probe.watch_peak()
    run()
    mlx_peak, end = probe.watched_peak()
    return max(
        mlx_peak - start.mlx_active_bytes,
        end.process_footprint_bytes - start.process_footprint_bytes,
        0,
    )


def _validate(probe: MemoryProbe, worst: _Pass, canary: int) -> int | None:
    """The worst pass's peak with the canary held (canary included); None when
    MLX cannot allocate (Metal raises on an allocation past its limit)."""
    try:
        return _measure(probe, worst, canary)
    except (RuntimeError, MemoryError) as exc:
        log.warning("memprofile: validation stress failed to allocate: %s", exc)
        return None


def _failure(
    dims: ModelDims,
    limits: Limits,
    baseline: int,
    overhead: int,
    canary: int,
    chunk: int,
    num_validations: int,
) -> InsufficientMemoryError:
    margin = limits.transient_margin_bytes
    need = baseline + max(overhead, margin) + canary + 2 * dims.kv_bytes_per_token * chunk
    if num_validations > PROFILE_MAX_RETRIES:
        what = f"no KV capacity held up in {num_validations} validation passes"
    else:
        what = f"the model does not leave room for one {chunk}-token prefill chunk"
    return InsufficientMemoryError(
        f"{what} under the "
        f"{format_bytes(limits.hard_bytes)} memory limit: resident {format_bytes(baseline)}, "
        f"measured step transient {format_bytes(overhead)}, transient margin "
        f"{format_bytes(margin)}, canary {format_bytes(canary)}, "
        f"KV {format_bytes(dims.kv_bytes_per_token)}/token. Raise memory.max_process_memory, "
        "lower scheduler.prefill_step_size or scheduler.max_concurrent_requests or "
        "memory.prefill_transient_margin, set "
        "memory.max_kv_tokens (or the model's max_kv_tokens) to pin a capacity and skip the "
        "profile, or load a smaller (more quantized) model",
        needed_bytes=need,
        limit_bytes=limits.hard_bytes,
        used_bytes=baseline,
    )
