"""KV-capacity auto-profile at model load (seed 002): measure instead of guess.

MLX thread only. Stress passes on the freshly loaded model (profile_stress.py)
measure the steps it will run: one request's full prefill chunk (the solo step),
the batched prefill at the widest the scheduler may run (max_concurrent_requests
rows x chunk; a slow model measures fewer rows and extrapolates, logged and
reported), one chunk over a long cached context and a decode step of a full
batch. The worst transient beyond each step's own KV sets the capacity and,
under ``prefill_transient_margin: auto``, the margin (x1.25, floored): the
widest batched step included, so the one margin covers a whole batched chunk
(admission stacks each request's modeled step on top: conservative). What a
step holds beyond the formulas (the long-context chunk's attention among them)
is added to every estimate (or carried by the measured margin).

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from omlx.engine.profile_stress import (
    DECODE_CONTEXT_TOKENS,
    Steps,
    Stress,
    measure,
    measure_steps,
    peak_delta,
)
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
)
from omlx.memory.probe import MemoryProbe
from omlx.memory.vision import encode_transient_bytes, pixel_shapes
from omlx.mlx_types import LanguageModel
from omlx.sizes import format_bytes

if TYPE_CHECKING:
    from omlx.models.vlm import VisionEncoder

log = logging.getLogger(__name__)

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
    context_window: int | None = None,
) -> KVProfile:
    """Measure the model's step transients and choose (or check) its KV capacity.

    ``max_tokens_in_flight`` bounds the KV validation holds: more than
    max_concurrent_requests x context window can never be in flight (default:
    one full batched step, ``batch_size`` x ``chunk_tokens``). ``context_window``
    bounds the long-context point (default: unbounded).

    Raises InsufficientMemoryError (507) when not even one prefill chunk fits,
    or the explicit capacity does not fit beside the worst step.
    """
    started = time.monotonic()
    stress = Stress(model, vocab_size, chunk_tokens, batch_size)
    reach = max_tokens_in_flight or batch_size * chunk_tokens
    if explicit_tokens is not None:
        return _check_explicit(
            stress, dims, probe, limits, explicit_tokens, min(explicit_tokens, reach), started
        )
    baseline = probe.reading(fresh=True).resident_bytes
    # An "auto" margin is not measured yet: its unmeasured default would leave no room.
    margin = limits.transient_margin_bytes if limits.margin_pinned else 0
    steps = measure_steps(
        stress,
        dims,
        probe,
        # The widest batched prefill: every request a row, no more than can be in flight.
        widest=max(1, min(batch_size, reach // chunk_tokens)),
        context_limit=context_window - chunk_tokens if context_window else reach,
        room=limits.hard_bytes - baseline - margin,
    )
    try:
        chosen = _choose_and_validate(stress, dims, probe, limits, steps, baseline, reach)
    finally:
        stress.decode_cache = []
    return _measured_profile(steps, chosen, _settled_baseline(probe, baseline), limits, started)


def _measured_profile(
    steps: Steps,
    chosen: tuple[int, int, int, Limits],
    teardown: int,
    limits: Limits,
    started: float,
) -> KVProfile:
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
        batch_rows=steps.batch.rows,
        batch_peak_bytes=steps.batch.peak,
        batch_rows_widest=steps.batch.widest,
        batch_widest_peak_bytes=steps.batch.widest_peak,
        long_context_tokens=steps.long.context_tokens,
        long_context_peak_bytes=steps.long.peak,
        long_context_estimate_bytes=steps.long.estimate,
        batch_row_bytes=steps.batch_row,
        unbatched_overhead_bytes=steps.unbatched,
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
    shapes = pixel_shapes(pixels)
    estimate = encode_transient_bytes(vision.dims, shapes, len(ids))
    room = limits.hard_bytes - limits.transient_margin_bytes
    room -= probe.reading(fresh=True).resident_bytes
    if estimate > room // 2:
        log.warning(
            "memprofile: image pass skipped: encoding one %s needs about %s and %s "
            "is left; image prompts are priced by the formula alone",
            _described(shapes),
            format_bytes(estimate),
            format_bytes(max(room, 0)),
        )
        return 0, estimate
    peak = measure(probe, lambda: mx.eval(vision.embed(ids, pixels, extras).arrays()))
    log.info(
        "memprofile: encoding one %s peaked at %s (the formula says %s)",
        _described(shapes),
        format_bytes(peak),
        format_bytes(estimate),
    )
    return peak, estimate


def _described(shapes: tuple[tuple[int, ...], ...]) -> str:
    """The stress image as the tower takes it: one array's sides, or its slices."""
    if len(shapes) == 1:
        return "x".join(str(d) for d in shapes[0][-2:]) + " image"
    return f"image of {len(shapes)} slices"


def _choose_and_validate(
    stress: Stress,
    dims: ModelDims,
    probe: MemoryProbe,
    limits: Limits,
    steps: Steps,
    baseline: int,
    reach: int,
) -> tuple[int, int, int, Limits]:
    """(capacity, attempt, KV bytes held in the passing validation, the model's limits)."""
    canary = canary_bytes(limits)
    # The margin follows the measured transient (when "auto"), as the guard's will.
    model_limits, extra = apply_measured_margin(
        limits, step_transient_bytes=steps.margin_step, unmodeled_bytes=steps.unmodeled
    )
    overhead, batch = steps.capacity_terms()
    validated = 0
    for attempt in range(PROFILE_MAX_RETRIES + 1):
        tokens = kv_capacity_tokens(
            model_limits,
            dims,
            baseline_bytes=baseline,
            chunk_tokens=stress.chunk,
            overhead_bytes=overhead,
            unmodeled_bytes=extra,
            canary_bytes=canary,
            attempt=attempt,
            batch=batch,
        )
        if tokens < stress.chunk:
            break  # shrinking cannot help
        validated = attempt + 1
        held = min(tokens, reach)
        # The measured batch is in the capacity: validation runs what the budget affords.
        check = _validate(stress, probe, held, canary, stress.batch_rows(held // stress.chunk))
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


@dataclass(frozen=True)
class _Check:
    # Resident bytes at the pass's peak: everything held plus the worst step.
    peak: int
    held_bytes: int
    # The worst step's bytes beyond the held KV and canary.
    transient: int


def _validate(
    stress: Stress, probe: MemoryProbe, tokens: int, canary: int, rows: int
) -> _Check | None:
    """Hold ``tokens`` of KV (less the batched step's ``rows`` chunks) and the canary,
    run every step beside them; None when MLX cannot allocate (Metal raises past its
    limit)."""
    held: list[mx.array] = []

    def run() -> None:
        held.extend(stress.hold_kv(max(0, tokens - rows * stress.chunk)))
        held.append(mx.full((max(1, canary // 4),), 1, dtype=mx.float32))
        mx.eval(held)
        stress.every_step(rows)

    mlx_stats.release_cache()
    try:
        before, delta = peak_delta(probe, run)
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
    stress: Stress,
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
    # The only pass: the batched step runs however slow the model (at least two rows).
    widest = max(1, min(stress.batch, held_tokens // stress.chunk))
    rows = stress.measured_rows(widest)
    try:
        check = _validate(stress, probe, held_tokens, canary, rows)
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
        batch_rows=rows,
        # The widest it may run; no extrapolation: the pinned capacity sets nothing.
        batch_rows_widest=widest,
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
