"""The auto-profile's stress passes (MLX thread only): the steps the scheduler will run,
measured on the freshly loaded model (profile.py turns them into a capacity).

* the solo step: one request's full prefill chunk;
* the batched prefill (``PrefillBatch``, as the runner steps it) at the widest the
  scheduler may run: max_concurrent_requests rows x chunk. A slow model measures
  fewer rows (at least two) and the per-row transient is extrapolated linearly to
  the widest, logged and reported (``KVProfile.batch_rows`` measured,
  ``batch_rows_widest``);
* a long-context point: one chunk attending over several chunks of cached context,
  whose transient beyond the formulas (``attention_transient_bytes``, the KV growth
  copy) is added to every estimate, so the guard uses the worse of measured and modeled;
* a decode step of a full batch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from omlx.engine.batch import PrefillBatch, Row
from omlx.memory import mlx_stats
from omlx.memory.budget import (
    BatchTransient,
    KVProfile,
    ModelDims,
    attention_transient_bytes,
    unmodeled_transient_bytes,
)
from omlx.memory.probe import MemoryProbe
from omlx.mlx_types import CacheLayer, LanguageModel, prompt_cache
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)

# Context each decode-stress sequence holds before its measured step.
DECODE_CONTEXT_TOKENS = 32
# Rows of the batched prefill measured: the widest the scheduler may run, as long as
# a pass takes at most this long at the measured one-row speed; a slower model
# measures fewer rows (never fewer than two) and extrapolates to the widest.
BATCH_STRESS_BUDGET_S = 0.25
# Warm solo chunks timed after the first (at most; they stop past the budget).
WARM_TIMINGS = 3
# The long-context point: one chunk over up to this many chunks of cached context,
# as many as this much time affords at the one-row speed (at least one): the load
# stays quick on a slow model, and a fast one measures the whole length.
LONG_CONTEXT_CHUNKS = 4
LONG_CONTEXT_BUDGET_S = 0.5


class Stress:
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
        # The last timed solo chunk's cache: the long-context point's first chunk of
        # context (one forward fewer on a slow model).
        self.solo_cache: list[CacheLayer] = []

    def _tokens(self, rows: int, length: int, offset: int = 0) -> mx.array:
        ids = (mx.arange(rows * length) + offset).reshape(rows, length) * 7919
        return (ids % (self._vocab - 1) + 1).astype(mx.int32)

    def batch_rows(self, most: int) -> int:
        """Rows validation runs batched: up to ``most``, within the time budget (below 2:
        none; the measured widest transient is in the capacity already)."""
        affordable = int(BATCH_STRESS_BUDGET_S / max(self.row_seconds, 1e-6))
        rows = min(most, self.batch, affordable)
        return rows if rows > 1 else 0

    def measured_rows(self, widest: int) -> int:
        """Rows the batched measurement runs: what the budget affords of ``widest``,
        never fewer than two (a batch of one is the solo pass); 0 when ``widest`` < 2."""
        return min(widest, max(2, self.batch_rows(widest))) if widest > 1 else 0

    def prefill(self) -> list[CacheLayer]:
        """One full prefill chunk of one request (cache state + last logits)."""
        cache = prompt_cache(self._model)
        logits = self._model(self._tokens(1, self.chunk), cache=cache)
        mx.eval(logits[:, -1, :], [c.state for c in cache])
        return cache

    def timed_prefill(self) -> None:
        """``prefill``, keeping the fastest time one row's chunk took (measurement
        only: validation's passes must not change the batched pass's rows)."""
        began = time.monotonic()
        self.solo_cache = []
        self.solo_cache = self.prefill()
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

    def context_cache(self, tokens: int) -> list[CacheLayer]:
        """One request's cache holding ``tokens`` of context, prefilled chunk by chunk
        as the runner would (each chunk evaluated before the next), from the solo
        pass's chunk when there is one."""
        reused, self.solo_cache = self.solo_cache, []
        first = self.chunk if reused and tokens >= self.chunk else 0
        cache = reused if first else prompt_cache(self._model)
        for start in range(first, tokens, self.chunk):
            ids = self._tokens(1, min(self.chunk, tokens - start), offset=start)
            mx.eval(self._model(ids, cache=cache)[:, -1, :], [c.state for c in cache])
        return cache

    def chunk_over(self, cache: list[CacheLayer]) -> None:
        """One more full chunk of the request whose context ``cache`` holds."""
        logits = self._model(self._tokens(1, self.chunk, offset=7), cache=cache)
        mx.eval(logits[:, -1, :], [c.state for c in cache])

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


def measure(probe: MemoryProbe, run: Callable[[], None]) -> int:
    """Bytes the pass added at its peak over what was resident before it."""
    mlx_stats.release_cache()
    try:
        return peak_delta(probe, run)[1]
    finally:
        mlx_stats.release_cache()


def peak_delta(probe: MemoryProbe, run: Callable[[], None]) -> tuple[int, int]:
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
class BatchPoint:
    """The batched prefill: ``rows`` measured (0: not run) of the ``widest`` the
    scheduler may run; peaks are bytes over what was resident."""

    rows: int
    widest: int
    peak: int
    # At the widest: the measured peak, or extrapolated from ``rows`` when fewer ran.
    widest_peak: int


@dataclass(frozen=True)
class LongPoint:
    """One chunk over ``context_tokens`` of cached context (0: not measured): its
    measured peak over what was resident, and what the formulas say it adds."""

    context_tokens: int
    peak: int
    estimate: int


@dataclass(frozen=True)
class Steps:
    """What the measurement passes found (peaks are bytes over what was resident)."""

    prefill_peak: int
    decode_peak: int
    batch: BatchPoint
    long: LongPoint
    # Worst step transient beyond the step's own KV.
    overhead: int
    # Of a step's transient, the most the estimate's formulas do not model.
    unmodeled: int
    # The widest batch's transient beyond its KV per row (0: none), and the worst of
    # the other steps': the capacity bounds the batched step by the KV in flight.
    batch_row: int = 0
    unbatched: int = 0

    def capacity_terms(self) -> tuple[int, BatchTransient | None]:
        """As ``KVProfile.capacity_terms``, for the capacity chosen before validation."""
        if self.batch_row and self.batch.widest > 1:
            return self.unbatched, BatchTransient(self.batch_row, self.batch.widest)
        return self.overhead, None

    @property
    def margin_step(self) -> int:
        """As ``KVProfile.margin_step_bytes``: one request's worst step, alone or a row."""
        if self.batch_row and self.batch.widest > 1:
            return max(self.unbatched, self.batch_row)
        return self.overhead


def measure_steps(
    stress: Stress,
    dims: ModelDims,
    probe: MemoryProbe,
    *,
    widest: int,
    context_limit: int,
    room: int,
) -> Steps:
    """The solo chunk (timed: the rows follow the model), the full-batch decode, the
    batched prefill at ``widest`` rows, and one chunk over at most ``context_limit``
    cached tokens when its KV and transient fit in half of ``room`` (bytes left
    under the hard limit less the margin)."""
    kv, chunk = dims.kv_bytes_per_token, stress.chunk
    prefill_peak = measure(probe, stress.timed_prefill)
    _warm_timings(stress)
    # The decode batch's context is built once: validation steps it again.
    stress.decode_cache = stress.decode_context()
    decode_peak = measure(probe, stress.decode_step)
    batch = _batch_pass(stress, kv, probe, widest)
    long = _long_context_pass(stress, dims, probe, context_limit, room)
    stress.solo_cache = []
    return _steps(dims, chunk, stress.batch, (prefill_peak, decode_peak), batch, long)


def _steps(
    dims: ModelDims,
    chunk: int,
    decode_rows: int,
    peaks: tuple[int, int],
    batch: BatchPoint,
    long: LongPoint,
) -> Steps:
    """The passes' peaks (solo chunk and decode in ``peaks``) as the transients the
    capacity and the margin are solved with."""
    kv = dims.kv_bytes_per_token
    prefill_peak, decode_peak = peaks
    batch_over = batch.widest_peak - kv * chunk * batch.widest
    overs = [prefill_peak - kv * chunk, decode_peak - kv * decode_rows]
    overs += [long.peak - kv * chunk] if long.context_tokens else []
    unbatched = max(*overs, 0)
    overs += [batch_over] if batch.rows else []
    if min(overs) < 0:
        log.warning("memprofile: a stress pass measured less than its own KV; clamped to 0")
    # Per row of the widest batch: admission and the forward gate price the rows one
    # by one, so only one row's step (as the solo chunk's) is in what every estimate
    # adds: the "auto" margin, or with a pinned margin the unmodeled bytes.
    row_over = -(-max(batch_over, 0) // batch.widest) if batch.rows else 0
    unmodeled = [
        unmodeled_transient_bytes(dims, chunk_tokens=chunk, measured_bytes=max(overs[0], 0)),
        unmodeled_transient_bytes(dims, chunk_tokens=chunk, measured_bytes=row_over),
        long.peak - long.estimate,
    ]
    return Steps(
        prefill_peak,
        decode_peak,
        batch,
        long,
        max(*overs, 0),
        unmodeled=max(*unmodeled, 0),
        batch_row=row_over,
        unbatched=unbatched,
    )


def _warm_timings(stress: Stress) -> None:
    """The first pass pays one-time costs (lazy weights, kernel builds) and a busy host
    slows any one pass: the fastest of a few warm ones is what a row's chunk costs,
    so the rows follow the model. They stop once they took the budget together."""
    warm_until = time.monotonic() + BATCH_STRESS_BUDGET_S
    if stress.row_seconds < BATCH_STRESS_BUDGET_S:
        for _ in range(WARM_TIMINGS):
            stress.timed_prefill()
            if time.monotonic() > warm_until:
                break


def _batch_pass(stress: Stress, kv_per_token: int, probe: MemoryProbe, widest: int) -> BatchPoint:
    rows = stress.measured_rows(widest)
    if rows == 0:
        return BatchPoint(0, widest, 0, 0)
    peak = measure(probe, lambda: stress.batched_prefill(rows))
    if rows == widest:
        return BatchPoint(rows, widest, peak, peak)
    # Each row brings its chunk's KV and its share of the step's transient; the step's
    # fixed part is scaled with them (conservative).
    row_kv = kv_per_token * stress.chunk
    over = max(0, peak - row_kv * rows)
    widest_peak = row_kv * widest + math.ceil(over * widest / rows)
    log.info(
        "memprofile: batched prefill measured at %d of %d rows (one row's chunk took %.2f s, "
        "budget %.2f s a pass): %s measured, %s extrapolated linearly to %d rows",
        rows,
        widest,
        stress.row_seconds,
        BATCH_STRESS_BUDGET_S,
        format_bytes(peak),
        format_bytes(widest_peak),
        widest,
    )
    return BatchPoint(rows, widest, peak, widest_peak)


def long_context_estimate(dims: ModelDims, chunk: int, context: int) -> int:
    """What the front door's formulas say one chunk over ``context`` cached tokens adds:
    its KV, its attention transient and the grown KV copied (old and new alive)."""
    attention = attention_transient_bytes(
        dims, chunk_tokens=chunk, num_context_tokens=context + chunk
    )
    return attention + dims.kv_bytes_per_token * (chunk + context + chunk)


def _long_context_pass(
    stress: Stress, dims: ModelDims, probe: MemoryProbe, context_limit: int, room: int
) -> LongPoint:
    chunk, kv = stress.chunk, dims.kv_bytes_per_token
    affordable = int(LONG_CONTEXT_BUDGET_S / max(stress.row_seconds, 1e-6))
    context = min(max(1, min(LONG_CONTEXT_CHUNKS, affordable)) * chunk, context_limit)

    # Its context's KV and the chunk's modeled transient: in half the room, or shorter.
    def fits(context: int) -> bool:
        return kv * context + long_context_estimate(dims, chunk, context) <= room // 2

    while context >= chunk and not fits(context):
        context -= chunk
    if context < chunk:
        log.warning(
            "memprofile: long-context pass not run: %s; a long prompt's chunk is priced by "
            "the formulas alone",
            f"the context window holds {context_limit + chunk} tokens, under two chunks"
            if context_limit < chunk
            else f"one chunk over a chunk of context does not fit in half of the "
            f"{format_bytes(max(room, 0))} left",
        )
        return LongPoint(0, 0, 0)
    cache = stress.context_cache(context)
    try:
        peak = measure(probe, lambda: stress.chunk_over(cache))
    finally:
        cache.clear()
    estimate = long_context_estimate(dims, chunk, context)
    log.info(
        "memprofile: one %d-token chunk over %d cached tokens peaked at %s (the formulas say %s)",
        chunk,
        context,
        format_bytes(peak),
        format_bytes(estimate),
    )
    return LongPoint(context, peak, estimate)


def stress_report(profile: KVProfile) -> dict[str, Any]:
    """What the profile measured and what it extrapolated (the load log, /health)."""
    return {
        "batch_rows_measured": profile.batch_rows,
        "batch_rows_widest": profile.batch_rows_widest,
        "batch_extrapolated": profile.batch_widest_peak_bytes > 0
        and 1 < profile.batch_rows < profile.batch_rows_widest,
        "batch_peak_bytes": profile.batch_peak_bytes,
        "batch_widest_peak_bytes": profile.batch_widest_peak_bytes,
        "long_context_tokens": profile.long_context_tokens,
        "long_context_peak_bytes": profile.long_context_peak_bytes,
        "long_context_estimate_bytes": profile.long_context_estimate_bytes,
    }
