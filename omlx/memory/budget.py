"""Memory budget arithmetic for prefill admission. Pure: no MLX, no psutil.

The scheduler, engines and enforcer feed in readings and counts; this module
answers three questions with one estimate:

* front door (``preflight``): can this request fit even with nothing else in flight?
* admission (``admit``): may it start now, or must it wait in the queue?
* forward gate (``gate``): may the next prefill chunk run, given a fresh reading?

Predicted peak = current bytes + KV of the new tokens + the attention transient
of one chunk + a transient margin for what no estimate models (MoE dequant
spikes, logits, allocator slack). All three checks compare it with the hard
limit, which is the configured ceiling itself.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from omlx.memory.dims import (
    ModelDims,
    conservative_dims,
    guard_dims,
    model_dims,
    written_columns,
)
from omlx.memory.kv_profile import BatchTransient, KVProfile
from omlx.sizes import format_bytes, parse_byte_size

__all__ = [
    "AdmitAction",
    "AdmitDecision",
    "BatchTransient",
    "KVProfile",
    "Limits",
    "MemoryReading",
    "ModelDims",
    "PrefillEstimate",
    "PrefillMemoryExceeded",
    "admit",
    "apply_measured_margin",
    "attention_transient_bytes",
    "canary_bytes",
    "conservative_dims",
    "estimate_prefill",
    "fused_sdpa_applies",
    "gate",
    "guard_dims",
    "held_tokens_peak_bytes",
    "kv_capacity_tokens",
    "measured_margin_bytes",
    "model_dims",
    "preflight",
    "resolve_limits",
    "row_excess_bytes",
]


GIB = 1024**3
# Reserve for macOS and other apps under "auto": 15% of RAM, at least 2 GiB, at most half.
AUTO_RESERVE_FRACTION = 0.15
AUTO_RESERVE_MIN_BYTES = 2 * GIB
# Head dims MLX's fused scaled_dot_product_attention kernel handles; others materialise scores.
FUSED_SDPA_HEAD_DIMS = frozenset({64, 80, 128})
# Unfused path holds bf16 scores and bf16 softmax output at once: 2 + 2 bytes per element.
SCORE_BYTES_PER_ELEMENT = 4
FUSED_BYTES_PER_ELEMENT = 4


def _positive(value: int, field: str) -> int:
    if value <= 0:
        raise ValueError(f"{field} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class Limits:
    """One immutable set of limits, published as a unit so readers never see a mix."""

    hard_bytes: int
    soft_bytes: int
    # The margin every estimate adds. When not pinned (setting "auto") this is the
    # value for a model nothing measured; a measured model's guard replaces it.
    transient_margin_bytes: int
    margin_pinned: bool = True


# "auto" transient margin: the auto-profile's worst measured step transient x 1.25
# (seed 000 padded a measured 10.6 GB spike to 12 GB, x1.13), at least 64 MiB for
# allocator slack and sampling buffers no stress pass exercises.
MARGIN_FACTOR = 1.25
MARGIN_FLOOR_BYTES = 64 * 1024**2
# A model whose transient nothing measured (capacity pinned, profile skipped) keeps
# the old fixed default: without a measurement, the Mac's safety comes first.
UNMEASURED_MARGIN_BYTES = GIB


def measured_margin_bytes(step_transient_bytes: int) -> int:
    """The "auto" margin from a measured worst step transient: x MARGIN_FACTOR, floored."""
    return max(MARGIN_FLOOR_BYTES, math.ceil(MARGIN_FACTOR * max(0, step_transient_bytes)))


def apply_measured_margin(
    limits: Limits, *, step_transient_bytes: int | None, unmodeled_bytes: int
) -> tuple[Limits, int]:
    """One model's limits and the unmodeled bytes its estimates add.

    Under "auto" with a measured step transient, the margin becomes that
    transient x MARGIN_FACTOR (floored) and carries the unmodeled part (which is
    inside what was measured), so it is not added twice. A pinned margin, or a
    model nothing measured (None), keeps the limits and adds the unmodeled bytes.
    """
    if limits.margin_pinned or step_transient_bytes is None:
        return limits, unmodeled_bytes
    margin = measured_margin_bytes(step_transient_bytes)
    return replace(limits, transient_margin_bytes=margin), 0


@dataclass(frozen=True, slots=True)
class DeviceCap:
    """What the GPU lets the process hold, read through MLX at start. On a Mac one
    allocation past Metal's working set can panic the machine (seed 000: a 128 GB Mac
    recommends 107.5 GB, below RAM x 0.85). None: not there (the CPU backend)."""

    working_set_bytes: int | None = None  # Metal's recommended max working set
    wired_limit_bytes: int | None = None  # macOS's iogpu.wired_limit_mb, when set

    @property
    def cap_bytes(self) -> int | None:
        known = [b for b in (self.working_set_bytes, self.wired_limit_bytes) if b]
        return min(known) if known else None


NO_DEVICE_CAP = DeviceCap()


def resolve_limits(
    max_process_memory: str | int,
    *,
    total_ram_bytes: int,
    soft_fraction: float = 0.85,
    transient_margin_bytes: int | None,
    device_cap: DeviceCap = NO_DEVICE_CAP,
) -> Limits:
    """Turn the ``max_process_memory`` setting into limits; the hard limit is the ceiling itself.

    ``"auto"`` = RAM minus a reserve of 15% of RAM, at least 2 GiB (macOS and a
    browser need a few GiB whatever the machine) and at most half of RAM (so an
    8 GiB machine still gets 6 GiB and a 2 GiB one 1 GiB). Otherwise bytes,
    ``"24GB"`` or ``"NN%"`` of RAM. Raises ValueError naming the field for a
    ceiling above physical RAM or a margin that leaves no room. A margin of
    None is "auto": measured per model (see ``measured_margin_bytes``). The
    ceiling is never above ``device_cap`` (Metal's working set, the wired limit).
    """
    _positive(total_ram_bytes, "total_ram_bytes")
    if isinstance(max_process_memory, str) and max_process_memory.strip().lower() == "auto":
        reserve = max(AUTO_RESERVE_MIN_BYTES, int(total_ram_bytes * AUTO_RESERVE_FRACTION))
        hard = total_ram_bytes - min(reserve, total_ram_bytes // 2)
    else:
        hard = parse_byte_size(
            max_process_memory, total_bytes=total_ram_bytes, field="max_process_memory"
        )
    if hard > total_ram_bytes:
        raise ValueError(
            f"max_process_memory: {format_bytes(hard)} is above physical RAM "
            f"({format_bytes(total_ram_bytes)})"
        )
    if device_cap.cap_bytes is not None:
        hard = min(hard, device_cap.cap_bytes)
    if not 0 < soft_fraction <= 1:
        raise ValueError(f"soft_fraction must be in (0, 1], got {soft_fraction}")
    if transient_margin_bytes is None:
        return Limits(hard, int(hard * soft_fraction), UNMEASURED_MARGIN_BYTES, margin_pinned=False)
    if not 0 <= transient_margin_bytes < hard:
        raise ValueError(
            f"prefill_transient_margin: {transient_margin_bytes} bytes must be at least 0 "
            f"and below max_process_memory ({format_bytes(hard)})"
        )
    return Limits(hard, int(hard * soft_fraction), transient_margin_bytes)


@dataclass(frozen=True)
class MemoryReading:
    """One sample of process memory. ``recent_peak_bytes`` is the enforcer's windowed maximum."""

    mlx_active_bytes: int
    process_footprint_bytes: int
    recent_peak_bytes: int
    taken_at_s: float
    # Freed MLX buffers kept for reuse: still held by the process.
    mlx_cache_bytes: int = 0

    @property
    def resident_bytes(self) -> int:
        """What is held now: the larger of MLX's view (active plus its buffer cache)
        and the OS's view. The footprint already holds the cache (Metal buffers on a
        Mac, heap pages on the CPU backend); MLX's sum covers a footprint that
        misses them (RSS on a Mac, when phys_footprint cannot be read)."""
        return max(self.mlx_active_bytes + self.mlx_cache_bytes, self.process_footprint_bytes)

    @property
    def in_use_bytes(self) -> int:
        """Resident bytes less MLX's cache of freed buffers, which MLX hands back
        on demand: what the process cannot give up without ending work."""
        return max(self.mlx_active_bytes, self.process_footprint_bytes - self.mlx_cache_bytes)

    @property
    def high_water(self) -> int:
        return max(self.resident_bytes, self.recent_peak_bytes)

    def current_bytes(self, *, others_in_flight: bool) -> int:
        """High water while other requests run; resident bytes when this request is alone.

        With nothing else in flight the recent peak belongs to finished work (or
        to this request's own earlier chunks, whose transient the estimate counts
        again), so it is stale and would only refuse a request that fits.
        """
        return self.high_water if others_in_flight else self.resident_bytes


def fused_sdpa_applies(head_dim: int) -> bool:
    """True when MLX's fused attention kernel covers this head size (no score matrix)."""
    return head_dim in FUSED_SDPA_HEAD_DIMS


def attention_transient_bytes(
    dims: ModelDims, *, chunk_tokens: int, num_context_tokens: int
) -> int:
    """Transient of one chunk attending over ``num_context_tokens`` (cached + earlier + chunk)."""
    if fused_sdpa_applies(dims.head_dim):
        return chunk_tokens * dims.num_attention_heads * dims.head_dim * FUSED_BYTES_PER_ELEMENT
    return chunk_tokens * num_context_tokens * dims.num_attention_heads * SCORE_BYTES_PER_ELEMENT


def prefill_step_transient_bytes(
    dims: ModelDims, chunk_tokens: int, num_context_tokens: int
) -> int:
    """What one request's prefill chunk holds beyond its own KV while it runs:
    its grown KV buffers are copied (old and new alive together: up to the whole
    context) and a few hidden-size activations per chunk token. Requests
    prefilled in one batch stack these, so admission counts one per request
    that will be prefilling next to the one it admits."""
    _positive(chunk_tokens, "chunk_tokens")
    kv_copy = dims.kv_bytes(num_context_tokens)
    activations = 4 * chunk_tokens * dims.hidden_size * max(dims.kv_dtype_bytes, 4)
    return kv_copy + activations


@dataclass(frozen=True)
class PrefillEstimate:
    current_bytes: int
    kv_bytes: int
    attention_bytes: int
    margin_bytes: int
    # A growing KV cache is copied into a larger buffer (old and new alive together).
    growth_bytes: int = 0
    # The auto-profile's measured chunk transient beyond the modeled terms.
    unmodeled_bytes: int = 0
    # The new sequence's fixed states (a hybrid's convolution / recurrent layers).
    state_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return (
            self.current_bytes
            + self.kv_bytes
            + self.attention_bytes
            + self.margin_bytes
            + self.growth_bytes
            + self.unmodeled_bytes
            + self.state_bytes
        )


def estimate_prefill(
    dims: ModelDims,
    reading: MemoryReading,
    *,
    num_new_tokens: int,
    num_cached_tokens: int,
    chunk_tokens: int,
    limits: Limits,
    others_in_flight: bool,
    unmodeled_bytes: int = 0,
    kv_step: int = 1,
) -> PrefillEstimate:
    """Predicted peak of a whole prefill: all new KV, the new sequence's fixed states
    (a hybrid's), plus the largest chunk transient. The grown cache as mlx-lm
    allocates it, ``kv_step`` columns at a time (``written_columns``), as the forward
    gate prices it.

    The last chunk attends over every token (cached + new), so its transient
    bounds every earlier chunk's; this is what makes an admitted request pass
    the forward gate when memory holds still.
    """
    if num_new_tokens < 0 or num_cached_tokens < 0:
        raise ValueError("token counts must not be negative")
    _positive(chunk_tokens, "chunk_tokens")
    attention = attention_transient_bytes(
        dims,
        chunk_tokens=min(chunk_tokens, num_new_tokens),
        num_context_tokens=num_cached_tokens + num_new_tokens,
    )
    return PrefillEstimate(
        current_bytes=reading.current_bytes(others_in_flight=others_in_flight),
        kv_bytes=dims.kv_bytes(num_new_tokens),
        attention_bytes=attention,
        margin_bytes=limits.transient_margin_bytes,
        growth_bytes=dims.kv_bytes(written_columns(num_cached_tokens + num_new_tokens, kv_step)),
        unmodeled_bytes=unmodeled_bytes,
        state_bytes=dims.state_bytes(1),
    )


class PrefillMemoryExceeded(Exception):
    """A prefill that cannot fit under the hard limit even with nothing else in flight.

    The API layer maps it to HTTP 400 with code ``prefill_memory_exceeded``.
    """

    def __init__(self, *, estimated_bytes: int, limit_bytes: int, hint: str) -> None:
        super().__init__(
            f"prefill needs about {format_bytes(estimated_bytes)} but max_process_memory is "
            f"{format_bytes(limit_bytes)}; {hint}"
        )
        self.estimated_bytes = estimated_bytes
        self.limit_bytes = limit_bytes
        self.hint = hint


def preflight(
    dims: ModelDims,
    *,
    baseline_bytes: int,
    num_new_tokens: int,
    num_cached_tokens: int,
    chunk_tokens: int,
    limits: Limits,
    unmodeled_bytes: int = 0,
    kv_step: int = 1,
) -> PrefillEstimate:
    """Front door: the estimate with only ``baseline_bytes`` (weights + runtime) resident.

    Raises PrefillMemoryExceeded when even that cannot fit: waiting would never
    help, so the request is refused instead of queued.
    """
    estimate = estimate_prefill(
        dims,
        MemoryReading(baseline_bytes, baseline_bytes, 0, taken_at_s=0.0),
        num_new_tokens=num_new_tokens,
        num_cached_tokens=num_cached_tokens,
        chunk_tokens=chunk_tokens,
        limits=limits,
        others_in_flight=False,
        unmodeled_bytes=unmodeled_bytes,
        kv_step=kv_step,
    )
    if estimate.peak_bytes > limits.hard_bytes:
        raise PrefillMemoryExceeded(
            estimated_bytes=estimate.peak_bytes,
            limit_bytes=limits.hard_bytes,
            hint=_hint(estimate, limits),
        )
    return estimate


def _hint(estimate: PrefillEstimate, limits: Limits) -> str:
    if estimate.current_bytes + estimate.margin_bytes >= limits.hard_bytes:
        return (
            f"the loaded models and the {format_bytes(estimate.margin_bytes)} transient "
            "margin fill it: unload another model, raise max_process_memory, load a smaller "
            "model, or (if the model's max_kv_tokens is pinned) set "
            "memory.prefill_transient_margin."
        )
    if estimate.attention_bytes > estimate.kv_bytes:
        return "the attention transient dominates: lower prefill_step_size or shorten the prompt."
    return "shorten the prompt or raise max_process_memory."


class AdmitAction(enum.Enum):
    ADMIT = "admit"
    DEFER = "defer"


@dataclass(frozen=True)
class AdmitDecision:
    action: AdmitAction
    reason: str  # for the memadmit log line

    @property
    def admitted(self) -> bool:
        return self.action is AdmitAction.ADMIT


def admit(estimate: PrefillEstimate, limits: Limits, *, num_in_flight: int) -> AdmitDecision:
    """Admission for a waiting request that already passed ``preflight``.

    ``num_in_flight`` counts running AND mid-prefill requests. With none, the
    request is admitted whatever the estimate says: it fit at the front door and
    nothing would drain, so deferring could deadlock the queue. Otherwise a
    peak over the hard limit defers it (it stays queued, re-checked next step).
    """
    peak, hard = format_bytes(estimate.peak_bytes), format_bytes(limits.hard_bytes)
    if num_in_flight == 0:
        return AdmitDecision(AdmitAction.ADMIT, f"nothing in flight (peak {peak}, hard {hard})")
    if estimate.peak_bytes > limits.hard_bytes:
        return AdmitDecision(
            AdmitAction.DEFER, f"peak {peak} > hard {hard} with {num_in_flight} in flight"
        )
    return AdmitDecision(AdmitAction.ADMIT, f"peak {peak} <= hard {hard}")


def gate(
    dims: ModelDims,
    fresh_reading: MemoryReading,
    *,
    chunk_tokens: int,
    num_cached_tokens: int,
    limits: Limits,
    others_in_flight: bool,
    unmodeled_bytes: int = 0,
    kv_step: int = 1,
) -> bool:
    """True when the next prefill chunk may run; False to end the request before the forward.

    ``num_cached_tokens`` is everything already in this request's cache
    (prefix hit + earlier chunks). Modeled chunk peak = resident + chunk KV +
    chunk attention + margin. While others are in flight, the recent measured
    peak may recur with this chunk's KV on top: it already holds real
    transients, so no margin is added to it. Alone, the recent peak belongs to
    finished work and is ignored. The cache the chunk grows into is counted as
    mlx-lm allocates it, ``kv_step`` columns at a time (``written_columns``: up to a
    step - 1 past the tokens); the chunk's own keys and values, as computed.
    """
    _positive(chunk_tokens, "chunk_tokens")
    attention = attention_transient_bytes(
        dims, chunk_tokens=chunk_tokens, num_context_tokens=num_cached_tokens + chunk_tokens
    )
    chunk_kv = dims.kv_bytes(chunk_tokens)
    growth = dims.kv_bytes(written_columns(num_cached_tokens + chunk_tokens, kv_step))
    peak = (
        fresh_reading.resident_bytes
        + chunk_kv
        + growth
        + attention
        + unmodeled_bytes
        + limits.transient_margin_bytes
    )
    if others_in_flight:
        peak = max(peak, fresh_reading.recent_peak_bytes + chunk_kv)
    return peak <= limits.hard_bytes


# Auto-profile (seed 002): each retry shrinks the capacity by 5%, at most 3 retries.
PROFILE_SHRINK = 0.95
PROFILE_MAX_RETRIES = 3
# The safety canary: reserved under the limit, held during the validation pass.
CANARY_MAX_BYTES = 256 * 1024**2
CANARY_FRACTION = 0.02


def canary_bytes(limits: Limits) -> int:
    return min(CANARY_MAX_BYTES, int(limits.hard_bytes * CANARY_FRACTION))


def held_tokens_peak_bytes(
    limits: Limits,
    dims: ModelDims,
    *,
    tokens: int,
    baseline_bytes: int,
    chunk_tokens: int,
    overhead_bytes: int,
    unmodeled_bytes: int,
    batch: BatchTransient | None = None,
) -> int:
    """Peak with ``tokens`` of KV held: the front door's estimate for a prompt that
    long (from the baseline), or the measured worst step (``overhead_bytes``, e.g.
    a full decode batch, or ``batch`` as wide as ``tokens`` make it) beside that KV,
    whichever is larger."""
    estimate = estimate_prefill(
        dims,
        MemoryReading(baseline_bytes, baseline_bytes, 0, taken_at_s=0.0),
        num_new_tokens=tokens,
        num_cached_tokens=0,
        chunk_tokens=chunk_tokens,
        limits=limits,
        others_in_flight=False,
        unmodeled_bytes=unmodeled_bytes,
    )
    if batch is not None:
        overhead_bytes = max(overhead_bytes, batch.at(tokens, chunk_tokens))
    step = baseline_bytes + dims.kv_bytes(tokens) + max(0, overhead_bytes)
    return max(estimate.peak_bytes, step)


def kv_capacity_tokens(
    limits: Limits,
    dims: ModelDims,
    *,
    baseline_bytes: int,
    chunk_tokens: int,
    overhead_bytes: int,
    unmodeled_bytes: int,
    canary_bytes: int,
    attempt: int = 0,
    batch: BatchTransient | None = None,
) -> int:
    """KV tokens whose ``held_tokens_peak_bytes`` fits under the hard limit beside
    the safety canary, shrunk 5% per retry. Solved from the front door's own
    estimate, so a prompt within capacity is never refused there."""

    def fits(tokens: int) -> bool:
        peak = held_tokens_peak_bytes(
            limits,
            dims,
            tokens=tokens,
            baseline_bytes=baseline_bytes,
            chunk_tokens=chunk_tokens,
            overhead_bytes=overhead_bytes,
            unmodeled_bytes=unmodeled_bytes,
            batch=batch,
        )
        return peak + canary_bytes <= limits.hard_bytes

    if not fits(0):
        return 0
    low = 0
    high = max(0, (limits.hard_bytes - baseline_bytes) // dims.kv_bytes_per_token)
    while low < high:  # the peak grows with the tokens: bisect the largest that fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return int(low * PROFILE_SHRINK**attempt)


def row_excess_bytes(dims: ModelDims, chunk_tokens: int, row_bytes: int) -> int:
    """What one row of a batched prefill held beyond its KV and the per-request
    transient admission counts (``prefill_step_transient_bytes``): added per row."""
    return max(0, row_bytes - prefill_step_transient_bytes(dims, chunk_tokens, chunk_tokens))


def unmodeled_transient_bytes(dims: ModelDims, *, chunk_tokens: int, measured_bytes: int) -> int:
    """What a measured prefill chunk held beyond its KV that the estimate's own terms
    (attention transient, KV growth copy) do not cover: added to every estimate."""
    modeled = attention_transient_bytes(
        dims, chunk_tokens=chunk_tokens, num_context_tokens=chunk_tokens
    ) + dims.kv_bytes(chunk_tokens)
    return max(0, measured_bytes - modeled)
