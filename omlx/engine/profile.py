"""KV-capacity auto-profile at model load (seed 002): measure instead of guess.

MLX thread only. Stress passes on the freshly loaded model measure the steps it
will run: one request's full prefill chunk (the solo step), the batched prefill
of several rows x chunk (``PrefillBatch``, as the runner steps it) and a decode
step of a full batch. The worst transient beyond each step's own KV sets the
capacity and, under ``prefill_transient_margin: auto``, the margin (x1.25,
floored): the batched step included, so the one margin covers a whole batched
chunk (admission stacks each request's modeled step on top: conservative).

A VLM's image pass encodes one image at its processor's largest size (vision
tower, projector, prompt embeddings) and records the peak beside the formula's
figure (memory/vision.py), so image prompts are priced by a measurement.

Validation allocates the chosen capacity's KV for real (the model's own per-layer
K/V shapes and dtype, every page written), holds it with a safety canary and runs
every step beside it; its measured peak must stay under the hard limit, or the
capacity shrinks 5% and validation repeats, at most 3 times, then the load fails
naming every knob. An explicit ``max_kv_tokens`` gets that one pass as a safety
net. After the passes, memory must come back to the pre-stress baseline.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from omlx.engine.batch import PrefillBatch, Row
from omlx.errors import InsufficientMemoryError
from omlx.memory import mlx_stats
from omlx.memory.budget import (
    PROFILE_MAX_RETRIES,
    KVProfile,
    Limits,
    ModelDims,
    apply_measured_margin,
    canary_bytes,
    kv_capacity_tokens,
    prefill_step_transient_bytes,
    unmodeled_transient_bytes,
)
from omlx.memory.probe import MemoryProbe
from omlx.memory.vision import vision_transient_bytes
from omlx.mlx_types import CacheLayer, LanguageModel, prompt_cache
from omlx.sizes import format_bytes

if TYPE_CHECKING:
    from omlx.models.vlm import VisionEncoder

log = logging.getLogger(__name__)

# Context each decode-stress sequence holds before its measured step.
DECODE_CONTEXT_TOKENS = 32
# Rows of the batched prefill stress: max_concurrent_requests (no more than the
# capacity holds), as long as a pass takes at most this long at the measured
# one-row speed. A slow model (the CPU backend, a large model) stresses fewer
# rows, or none when two would not fit: the load must stay quick, and admission
# still stacks each admitted request's step transient.
BATCH_STRESS_BUDGET_S = 0.25
# Warm solo chunks timed after the first (at most; they stop past the budget).
WARM_TIMINGS = 3
# Memory still held after the passes beyond this (or 2% of the baseline) is
# reported and counted in the baseline: allocator slack stays below it.
TEARDOWN_TOLERANCE_BYTES = 32 * 1024**2
TEARDOWN_TOLERANCE_FRACTION = 0.02


@contextmanager
def _no_collection_during_passes() -> Iterator[None]:
    """Garbage from earlier work (arrays kept by reference cycles) collected in the
    middle of a pass would free memory during its measurement and hide part of its
    peak: collect it first, and none until the passes are done."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_no_collection_during_passes()
def auto_profile(
    model: LanguageModel,
    dims: ModelDims,
    probe: MemoryProbe,
    limits: Limits,
    *,
    chunk_tokens: int,
    batch_size: int,
    vocab_size: int,
    explicit_tokens: int | None = None,
    max_tokens_in_flight: int | None = None,
) -> KVProfile:
    """Measure the model's step transients and choose (or check) its KV capacity.

    ``max_tokens_in_flight`` bounds the KV validation holds: more than
    max_concurrent_requests x context window can never be in flight (default:
    one full batched step, ``batch_size`` x ``chunk_tokens``).

    Raises InsufficientMemoryError (507) when not even one prefill chunk fits,
    or the explicit capacity does not fit beside the worst step.
    """
    started = time.monotonic()
    baseline = probe.reading(fresh=True).resident_bytes
    stress = _Stress(model, vocab_size, chunk_tokens, batch_size)
    reach = max_tokens_in_flight or batch_size * chunk_tokens
    if explicit_tokens is not None:
        return _check_explicit(
            stress, dims, probe, limits, explicit_tokens, min(explicit_tokens, reach), started
        )
    steps = _measure_steps(stress, dims, probe)
    try:
        chosen = _choose_and_validate(stress, dims, probe, limits, steps, baseline, reach)
    finally:
        stress.decode_cache = []
    teardown = _settled_baseline(probe, baseline)
    tokens, attempt, held, model_limits = chosen
    return KVProfile(
        max_kv_tokens=tokens,
        source="measured",
        baseline_bytes=teardown,
        prefill_peak_bytes=steps.prefill_peak,
        decode_peak_bytes=steps.decode_peak,
        overhead_bytes=steps.overhead,
        unmodeled_bytes=steps.unmodeled,
        margin_bytes=model_limits.transient_margin_bytes,
        canary_bytes=canary_bytes(limits),
        attempts=attempt + 1,
        seconds=time.monotonic() - started,
        batch_rows=steps.batch_rows,
        batch_peak_bytes=steps.batch_peak,
        held_kv_bytes=held,
        teardown_bytes=teardown,
    )


def measure_image(vision: VisionEncoder, probe: MemoryProbe, limits: Limits) -> tuple[int, int]:
    """(measured peak, the formula's figure) of encoding one image at the processor's
    largest size; the peak is 0 (not measured) when the formula says it would not fit
    twice over in the room left, so the profile never runs the process out of memory.
    A pass that fails (a processor that refuses the synthetic image, an allocation
    refused) is logged and leaves images priced by the formula: it never fails a load."""
    try:
        return _image_pass(vision, probe, limits)
    except (RuntimeError, ValueError, TypeError, KeyError, MemoryError) as exc:
        log.warning("memprofile: image pass failed (%s); images priced by the formula", exc)
        return 0, 0


def _image_pass(vision: VisionEncoder, probe: MemoryProbe, limits: Limits) -> tuple[int, int]:
    ids, pixels, extras = vision.stress_inputs()
    estimate = vision_transient_bytes(vision.dims, pixels.shape, len(ids))
    room = limits.hard_bytes - limits.transient_margin_bytes
    room -= probe.reading(fresh=True).resident_bytes
    if estimate > room // 2:
        log.warning(
            "memprofile: image pass skipped: encoding one %s image needs about %s and %s "
            "is left; image prompts are priced by the formula alone",
            "x".join(str(d) for d in pixels.shape[-2:]),
            format_bytes(estimate),
            format_bytes(max(room, 0)),
        )
        return 0, estimate
    peak = _measure(probe, lambda: mx.eval(vision.embed(ids, pixels, extras).arrays()))
    log.info(
        "memprofile: encoding one %s image peaked at %s (the formula says %s)",
        "x".join(str(d) for d in pixels.shape[-2:]),
        format_bytes(peak),
        format_bytes(estimate),
    )
    return peak, estimate


@dataclass(frozen=True)
class _Steps:
    """What the measurement passes found (peaks are bytes over what was resident)."""

    prefill_peak: int
    decode_peak: int
    batch_peak: int
    batch_rows: int
    # Worst step transient beyond the step's own KV.
    overhead: int
    unmodeled: int


def _measure_steps(stress: _Stress, dims: ModelDims, probe: MemoryProbe) -> _Steps:
    kv, chunk = dims.kv_bytes_per_token, stress.chunk
    prefill_peak = _measure(probe, stress.timed_prefill)
    # The first pass pays one-time costs (lazy weights, kernel builds) and a busy host
    # slows any one pass: the fastest of a few warm ones is what a row's chunk costs,
    # so the rows follow the model. They stop once they took the budget together.
    warm_until = time.monotonic() + BATCH_STRESS_BUDGET_S
    if stress.row_seconds < BATCH_STRESS_BUDGET_S:
        for _ in range(WARM_TIMINGS):
            stress.timed_prefill()
            if time.monotonic() > warm_until:
                break
    # The decode batch's context is built once: validation steps it again.
    stress.decode_cache = stress.decode_context()
    decode_peak = _measure(probe, stress.decode_step)
    rows = stress.batch_rows(stress.batch)
    if rows < stress.batch:
        log.info(
            "memprofile: batched prefill stressed at %d of %d rows: one row's chunk took "
            "%.2f s (budget %.2f s a pass); admission stacks the rest per request",
            rows,
            stress.batch,
            stress.row_seconds,
            BATCH_STRESS_BUDGET_S,
        )
    batch_peak = _measure(probe, lambda: stress.batched_prefill(rows)) if rows > 1 else 0
    overs = [prefill_peak - kv * chunk, decode_peak - kv * stress.batch]
    if rows > 1:
        overs.append(batch_peak - kv * chunk * rows)
    if min(overs) < 0:
        log.warning("memprofile: a stress pass measured less than its own KV; clamped to 0")
    # Per row of the batch, what admission's modeled step transient does not cover.
    row_over = max(overs[2], 0) // rows if rows > 1 else 0
    batch_unmodeled = max(0, row_over - prefill_step_transient_bytes(dims, chunk, chunk))
    solo_unmodeled = unmodeled_transient_bytes(
        dims, chunk_tokens=chunk, measured_bytes=max(overs[0], 0)
    )
    return _Steps(
        prefill_peak,
        decode_peak,
        batch_peak,
        rows,
        overhead=max(*overs, 0),
        unmodeled=max(solo_unmodeled, batch_unmodeled),
    )


def _choose_and_validate(
    stress: _Stress,
    dims: ModelDims,
    probe: MemoryProbe,
    limits: Limits,
    steps: _Steps,
    baseline: int,
    reach: int,
) -> tuple[int, int, int, Limits]:
    """(capacity, attempt, KV bytes held in the passing validation, the model's limits)."""
    canary = canary_bytes(limits)
    # The margin follows the measured transient (when "auto"), as the guard's will.
    model_limits, extra = apply_measured_margin(
        limits, step_transient_bytes=steps.overhead, unmodeled_bytes=steps.unmodeled
    )
    validated = 0
    for attempt in range(PROFILE_MAX_RETRIES + 1):
        tokens = kv_capacity_tokens(
            model_limits,
            dims,
            baseline_bytes=baseline,
            chunk_tokens=stress.chunk,
            overhead_bytes=steps.overhead,
            unmodeled_bytes=extra,
            canary_bytes=canary,
            attempt=attempt,
        )
        if tokens < stress.chunk:
            break  # shrinking cannot help
        validated = attempt + 1
        check = _validate(stress, probe, min(tokens, reach), canary)
        if check is not None and check.peak <= limits.hard_bytes:
            return tokens, attempt, check.held_bytes, model_limits
        log.warning(
            "memprofile: validation attempt %d of %d KV tokens %s; shrinking 5%%",
            attempt + 1,
            tokens,
            "failed to allocate"
            if check is None
            else f"peaked at {format_bytes(check.peak)} > {format_bytes(limits.hard_bytes)}",
        )
    raise _failure(dims, model_limits, baseline, steps.overhead, canary, stress.chunk, validated)


class _Stress:
    """The stress passes, on token ids spread over the vocabulary."""

    def __init__(self, model: LanguageModel, vocab_size: int, chunk_tokens: int, batch_size: int):
        self._model = model
        self._vocab = max(2, vocab_size)
        self.chunk = chunk_tokens
        self.batch = batch_size
        # The fastest one row's chunk took (the solo pass), for the batched pass's rows.
        self.row_seconds = math.inf
        # A full batch of sequences with a short context, for the decode step.
        self.decode_cache: list[CacheLayer] = []

    def _tokens(self, rows: int, length: int) -> mx.array:
        ids = mx.arange(rows * length).reshape(rows, length) * 7919 % (self._vocab - 1) + 1
        return ids.astype(mx.int32)

    def batch_rows(self, most: int) -> int:
        """Rows for the batched pass: up to ``most``, within the time budget (below 2: none)."""
        affordable = int(BATCH_STRESS_BUDGET_S / max(self.row_seconds, 1e-6))
        rows = min(most, self.batch, affordable)
        return rows if rows > 1 else 0

    def prefill(self) -> None:
        """One full prefill chunk of one request (cache state + last logits)."""
        cache = prompt_cache(self._model)
        logits = self._model(self._tokens(1, self.chunk), cache=cache)
        mx.eval(logits[:, -1, :], [c.state for c in cache])

    def timed_prefill(self) -> None:
        """``prefill``, keeping the fastest time one row's chunk took (measurement
        only: validation's passes must not change the batched pass's rows)."""
        began = time.monotonic()
        self.prefill()
        self.row_seconds = min(self.row_seconds, time.monotonic() - began)

    def batched_prefill(self, rows: int) -> None:
        """One step of the runner's batched prefill: a chunk of each of ``rows`` prompts."""
        batch = PrefillBatch(self._model, self.chunk)
        length = self.chunk + 1
        for i in range(rows):
            prompt = [(i * length + j) * 7919 % (self._vocab - 1) + 1 for j in range(length)]
            row = Row(f"memprofile-{i}", _greedy, [])
            batch.add(row, prompt_cache(self._model), 0, prompt)
        _, cache = batch.step()
        mx.eval([c.state for c in cache])

    def decode_context(self) -> list[CacheLayer]:
        cache = prompt_cache(self._model)
        context = self._tokens(self.batch, DECODE_CONTEXT_TOKENS)
        mx.eval([c.state for c in cache], self._model(context, cache=cache)[:, -1, :])
        return cache

    def decode_step(self) -> None:
        """One decode step of a full batch (context built first when there is none)."""
        if not self.decode_cache:
            self.decode_cache = self.decode_context()
        cache = self.decode_cache
        logits = self._model(self._tokens(self.batch, 1), cache=cache)
        mx.eval(logits, [c.state for c in cache])

    def every_step(self, batch_rows: int) -> None:
        """The solo chunk, the batched chunk and the full-batch decode, one after another."""
        self.prefill()
        if batch_rows > 1:
            self.batched_prefill(batch_rows)
        self.decode_step()

    def hold_kv(self, tokens: int) -> list[mx.array]:
        """KV for ``tokens`` in the model's own per-layer K/V shapes and dtypes (those
        of the decode batch's cache), every page written: MLX allocates lazily, so
        zeros or an unevaluated array would commit nothing."""
        if not self.decode_cache:
            self.decode_cache = self.decode_context()
        held = []
        for layer in self.decode_cache:
            limit = getattr(layer, "max_size", None) or tokens  # a sliding window holds less
            for part in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                for a in part if isinstance(part, (tuple, list)) else [part]:
                    if isinstance(a, mx.array) and a.ndim == 4:
                        shape = (1, a.shape[1], min(tokens, limit), a.shape[3])
                        held.append(mx.full(shape, 1, dtype=a.dtype))
        mx.eval(held)
        return held


def _greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def _measure(probe: MemoryProbe, run: Callable[[], None]) -> int:
    """Bytes the pass added at its peak over what was resident before it."""
    mlx_stats.release_cache()
    try:
        return _peak_delta(probe, run)[1]
    finally:
        mlx_stats.release_cache()


def _peak_delta(probe: MemoryProbe, run: Callable[[], None]) -> tuple[int, int]:
    """(resident bytes before, the most ``run`` added over them at its peak). MLX's
    peak covers device allocations; the footprint covers the rest (on the CPU
    backend MLX memory is part of it, so take whichever grew more)."""
    start = probe.watch_peak()
    run()
    mlx_peak, end = probe.watched_peak()
    delta = max(
        mlx_peak - start.mlx_active_bytes,
        end.process_footprint_bytes - start.process_footprint_bytes,
        0,
    )
    return start.resident_bytes, delta


@dataclass(frozen=True)
class _Check:
    # Resident bytes at the pass's peak: everything held plus the worst step.
    peak: int
    held_bytes: int
    # The worst step's bytes beyond the held KV and canary.
    transient: int


def _validate(stress: _Stress, probe: MemoryProbe, tokens: int, canary: int) -> _Check | None:
    """Hold ``tokens`` of KV (less the batched step's own) and the canary, run every
    step beside them; None when MLX cannot allocate (Metal raises past its limit)."""
    rows = stress.batch_rows(tokens // stress.chunk)
    held: list[mx.array] = []

    def run() -> None:
        held.extend(stress.hold_kv(max(0, tokens - rows * stress.chunk)))
        held.append(mx.full((max(1, canary // 4),), 1, dtype=mx.float32))
        mx.eval(held)
        stress.every_step(rows)

    mlx_stats.release_cache()
    try:
        before, delta = _peak_delta(probe, run)
        held_bytes = sum(a.nbytes for a in held[:-1])
        return _Check(before + delta, held_bytes, max(0, delta - held_bytes - canary))
    except (RuntimeError, MemoryError) as exc:
        log.warning("memprofile: validation stress failed to allocate: %s", exc)
        return None
    finally:
        held.clear()
        mlx_stats.release_cache()


def _settled_baseline(probe: MemoryProbe, baseline: int) -> int:
    """After the passes: everything dropped, MLX's cache freed, a fresh reading. Memory
    that did not come back is reported, and the higher reading is the baseline."""
    gc.collect()
    mlx_stats.release_cache()
    now = probe.reading(fresh=True).resident_bytes
    tolerance = max(TEARDOWN_TOLERANCE_BYTES, int(baseline * TEARDOWN_TOLERANCE_FRACTION))
    if now - baseline <= tolerance:
        return baseline
    log.warning(
        "memprofile: memory did not come back after the stress passes: %s resident, "
        "%s before them (%s more, tolerance %s); counting the higher reading as the baseline",
        format_bytes(now),
        format_bytes(baseline),
        format_bytes(now - baseline),
        format_bytes(tolerance),
    )
    return now


def _check_explicit(
    stress: _Stress,
    dims: ModelDims,
    probe: MemoryProbe,
    limits: Limits,
    explicit: int,
    held_tokens: int,
    started: float,
) -> KVProfile:
    """The safety net for a pinned capacity: one pass of every step beside its KV."""
    baseline = probe.reading(fresh=True).resident_bytes
    began = time.monotonic()
    stress.decode_cache = stress.decode_context()
    # One row's chunk at the speed the decode batch's context was prefilled.
    per_token = (time.monotonic() - began) / (stress.batch * DECODE_CONTEXT_TOKENS)
    stress.row_seconds = per_token * stress.chunk
    canary = canary_bytes(limits)
    try:
        check = _validate(stress, probe, held_tokens, canary)
    finally:
        stress.decode_cache = []
    if check is None or check.peak > limits.hard_bytes:
        raise _explicit_failure(dims, limits, explicit, held_tokens, check)
    teardown = _settled_baseline(probe, baseline)
    return KVProfile(
        explicit,
        "explicit",
        teardown,
        overhead_bytes=check.transient,
        margin_bytes=limits.transient_margin_bytes,
        canary_bytes=canary,
        attempts=1,
        seconds=time.monotonic() - started,
        batch_rows=stress.batch_rows(held_tokens // stress.chunk),
        held_kv_bytes=check.held_bytes,
        teardown_bytes=teardown,
    )


def _explicit_failure(
    dims: ModelDims, limits: Limits, explicit: int, held_tokens: int, check: _Check | None
) -> InsufficientMemoryError:
    hard = limits.hard_bytes
    per_token = dims.kv_bytes_per_token
    if check is not None and check.held_bytes and held_tokens:
        per_token = max(per_token, math.ceil(check.held_bytes / held_tokens))
    over = check.peak - hard if check is not None else explicit * per_token
    fits = max(0, explicit - math.ceil(over / per_token))
    peak = f"peaks at {format_bytes(check.peak)}" if check is not None else "failed to allocate"
    return InsufficientMemoryError(
        f"max_kv_tokens {explicit} does not fit under the {format_bytes(hard)} memory "
        f"limit: its KV beside the model's worst step and the canary {peak}; about {fits} "
        "KV tokens would fit. Lower memory.max_kv_tokens (or the model's max_kv_tokens) to "
        f"{fits} or less, unset it to let the profile choose, raise "
        "memory.max_process_memory, or lower scheduler.prefill_step_size or "
        "scheduler.max_concurrent_requests",
        needed_bytes=check.peak if check is not None else hard + over,
        limit_bytes=hard,
        used_bytes=check.peak - check.transient if check is not None else 0,
    )


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
