"""One model's memory guard: the front-door preflight every engine path runs.

Limits are published as one immutable object (a reference swap), so a model
loaded after start is guarded as soon as it has a guard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from omlx.errors import PrefillMemoryExceededError, SettingsError
from omlx.memory.budget import (
    MARGIN_FACTOR,
    MARGIN_FLOOR_BYTES,
    NO_DEVICE_CAP,
    DeviceCap,
    KVProfile,
    Limits,
    MemoryReading,
    ModelDims,
    PrefillMemoryExceeded,
    admit,
    apply_measured_margin,
    canary_bytes,
    estimate_prefill,
    gate,
    held_tokens_peak_bytes,
    kv_capacity_tokens,
    preflight,
    resolve_limits,
    row_excess_bytes,
)
from omlx.memory.dims import allocated_columns
from omlx.settings import MemorySettings
from omlx.sizes import format_bytes, parse_byte_size

log = logging.getLogger(__name__)


def memory_limits(
    settings: MemorySettings, total_ram_bytes: int, device_cap: DeviceCap = NO_DEVICE_CAP
) -> Limits:
    """The hard/soft limits from settings, under the GPU's cap; SettingsError naming
    the field if invalid."""
    try:
        margin = _pinned_margin(settings.prefill_transient_margin)
        return resolve_limits(
            settings.max_process_memory,
            total_ram_bytes=total_ram_bytes,
            soft_fraction=settings.soft_fraction,
            transient_margin_bytes=margin,
            device_cap=device_cap,
        )
    except ValueError as exc:
        raise SettingsError(f"invalid memory setting: {exc}") from None


def _pinned_margin(value: str | int) -> int | None:
    """A size pins the margin; "auto" (None) lets each model's auto-profile set it."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    return parse_byte_size(value, field="memory.prefill_transient_margin")


class MemoryGuard:
    """``baseline`` answers, at each call, what the process holds with nothing in
    flight (``omlx/memory/baseline.py``): the front door and the KV capacity
    follow the live machine, not the moment this model loaded."""

    def __init__(
        self,
        model: str,
        dims: ModelDims,
        *,
        limits: Limits,
        baseline: Callable[[], int],
        chunk_tokens: int,
        kv_step: int = 1,
    ):
        self.model = model
        # The columns the model's KV caches grow by at a time (mlx-lm's ``step``, read
        # at load: engine/kv_measure.cache_step); the front door counts a prompt as its
        # cache holds it (``allocated_columns``), as the scheduler counts rows.
        self.kv_step = kv_step
        self.dims = dims
        # The published limits, and this model's view of them (its own margin).
        self._published = limits
        self.limits = limits
        self._unmodeled = 0
        self._margin_measured = False
        self._baseline = baseline
        self.chunk_tokens = chunk_tokens
        # Set once the load-time auto-profile (or an explicit max_kv_tokens) ran.
        self.profile: KVProfile | None = None

    def set_profile(self, profile: KVProfile) -> None:
        self.profile = profile
        self.publish(self._published)

    @property
    def baseline_bytes(self) -> int:
        """Process memory with nothing in flight, now (this model loaded)."""
        return self._baseline()

    @property
    def unmodeled_bytes(self) -> int:
        """Measured transient the formulas miss, when the margin does not already carry it."""
        return self._unmodeled

    @property
    def row_excess_bytes(self) -> int:
        """What each row of a batched prefill holds beyond the per-request formulas
        admission counts (``prefill_step_transient_bytes``), as the auto-profile's
        widest batch measured it (a full chunk a row): admission adds it per row's
        chunk (``batch_excess_bytes``), so the margin needs to cover only one row's step."""
        p = self._measured_batch()
        return row_excess_bytes(self.dims, self.chunk_tokens, p.batch_row_bytes) if p else 0

    def batch_excess_bytes(self, num_tokens: int) -> int:
        """``row_excess_bytes`` for ``num_tokens`` prefilled in one step: it grows with
        the rows' tokens (activations, scores), so a capped chunk brings less of it."""
        return -(-self.row_excess_bytes * num_tokens // self.chunk_tokens)

    def step_excess_bytes(self, num_tokens: int) -> int:
        """The forward gate's price of a step's rows beyond its first chunk: each further
        chunk's worth of tokens is another row, which holds its measured transient
        beyond the KV growth the gate counts. The first chunk's row pays nothing here:
        the margin (or, pinned, the unmodeled bytes) covers one row's step whole."""
        p = self._measured_batch()
        if p is None:
            return 0
        row = max(0, p.batch_row_bytes - self.dims.kv_bytes_per_token * self.chunk_tokens)
        return -(-row * max(0, num_tokens - self.chunk_tokens) // self.chunk_tokens)

    def _measured_batch(self) -> KVProfile | None:
        """The profile when it measured a batched prefill (its rows are priced), else None."""
        p = self.profile
        return p if p is not None and p.source == "measured" and p.batched else None

    @property
    def max_kv_tokens(self) -> int | None:
        """The KV capacity: explicit, or recomputed from the measured transient
        under the limits in force now (they change with settings) and the live
        baseline (other models load and unload)."""
        return self._capacity(self.baseline_bytes)

    def _capacity(self, baseline_bytes: int) -> int | None:
        p = self.profile
        if p is None or p.source == "explicit":
            return p.max_kv_tokens if p is not None else None
        overhead, batch = p.capacity_terms()
        return kv_capacity_tokens(
            self.limits,
            self.dims,
            baseline_bytes=baseline_bytes,
            chunk_tokens=self.chunk_tokens,
            overhead_bytes=overhead,
            unmodeled_bytes=self.unmodeled_bytes,
            canary_bytes=canary_bytes(self.limits),
            attempt=p.attempts - 1,
            batch=batch,
        )

    @property
    def margin_source(self) -> str:
        """Where the transient margin comes from, for the log and the admin API."""
        if self.limits.margin_pinned:
            return "pinned by memory.prefill_transient_margin"
        if self._margin_measured:
            return f"auto: measured step transient x{MARGIN_FACTOR}, at least " + format_bytes(
                MARGIN_FLOOR_BYTES
            )
        return "auto, unmeasured: the capacity is pinned, so the fixed default applies"

    def kv_fits(self, num_tokens_in_flight: int, num_new_tokens: int, num_rows: int = 0) -> bool:
        """Admission by KV capacity: the running requests' tokens plus this prompt, and
        the fixed states of ``num_rows`` rows (``kv_tokens``)."""
        cap = self.max_kv_tokens
        return cap is None or self.kv_tokens(num_tokens_in_flight + num_new_tokens, num_rows) <= cap

    def kv_tokens(self, num_tokens: int, num_rows: int) -> int:
        """What ``num_rows`` rows holding ``num_tokens`` KV tokens take of the KV capacity:
        each row also holds a hybrid's fixed states, counted in KV tokens (0 without)."""
        return num_tokens + self.dims.state_tokens_per_sequence * num_rows

    def publish(self, limits: Limits) -> None:
        """Take new limits; an "auto" margin becomes this model's measured one."""
        self._published, p = limits, self.profile
        measured = p is not None and p.source == "measured"
        self._margin_measured = measured and not limits.margin_pinned
        self.limits, self._unmodeled = apply_measured_margin(
            limits,
            step_transient_bytes=p.margin_step_bytes if p is not None and measured else None,
            unmodeled_bytes=p.unmodeled_bytes if p is not None else 0,
        )

    def admit(
        self,
        num_prompt_tokens: int,
        num_in_flight: int,
        reading: MemoryReading,
        one_forward: bool = False,
    ) -> bool:
        """Scheduler admission: False keeps the request queued (re-checked next step).
        Logs each deferral (``memadmit``). The request will be a row of a batched
        prefill: its row's measured excess counts. ``one_forward``: its prompt goes in
        one forward, not in chunks (a whole-prompt image prompt)."""
        chunk_tokens = num_prompt_tokens if one_forward else self.chunk_tokens
        chunk = min(num_prompt_tokens, chunk_tokens)
        estimate = estimate_prefill(
            self.dims,
            reading,
            num_new_tokens=num_prompt_tokens,
            num_cached_tokens=0,
            chunk_tokens=chunk_tokens,
            limits=self.limits,
            others_in_flight=num_in_flight > 0,
            unmodeled_bytes=self.unmodeled_bytes + self.batch_excess_bytes(chunk),
            kv_step=self.kv_step,
        )
        decision = admit(estimate, self.limits, num_in_flight=num_in_flight)
        if not decision.admitted:
            log.info(
                "memadmit %s: deferred a %d-token prompt: %s",
                self.model,
                num_prompt_tokens,
                decision.reason,
            )
        return decision.admitted

    def gate(
        self, chunk_tokens: int, num_cached_tokens: int, reading: MemoryReading, *, others: bool
    ) -> bool:
        """Forward gate: may the next prefill step (``chunk_tokens`` of one or more
        requests' chunks together) run under the hard limit? A step of one chunk is one
        request's step, which the margin covers; more is a batch (``step_excess_bytes``).
        The chunk's KV is priced as its cache grows (``kv_step`` columns at a time)."""
        return gate(
            self.dims,
            reading,
            chunk_tokens=chunk_tokens,
            num_cached_tokens=num_cached_tokens,
            limits=self.limits,
            others_in_flight=others,
            unmodeled_bytes=self.unmodeled_bytes + self.step_excess_bytes(chunk_tokens),
            kv_step=self.kv_step,
        )

    def check_prefill(
        self,
        num_prompt_tokens: int,
        num_cached_tokens: int = 0,
        extra_bytes: int = 0,
        image_bytes: int = 0,
        held_state_bytes: int = 0,
        one_forward: bool = False,
    ) -> None:
        """Raise PrefillMemoryExceededError (HTTP 400) for a prompt that cannot fit
        under the hard limit even with nothing else in flight. The estimate goes
        first: its message names the knob that helps. ``extra_bytes``: a chunk's
        transient beyond a prefill's (a scoring pass's logits); ``image_bytes``: the
        transient of encoding the prompt's images (memory/vision.py);
        ``held_state_bytes``: the image states the request then holds while it runs
        (mllama's), counted against the KV capacity with its cache; ``one_forward``:
        the prompt goes in one forward, not in chunks (gate_inputs.request_one_forward)."""
        baseline = self.baseline_bytes
        try:
            preflight(
                self.dims,
                baseline_bytes=baseline,
                num_new_tokens=num_prompt_tokens - num_cached_tokens,
                num_cached_tokens=num_cached_tokens,
                chunk_tokens=num_prompt_tokens if one_forward else self.chunk_tokens,
                limits=self.limits,
                unmodeled_bytes=self.unmodeled_bytes + extra_bytes + image_bytes,
                kv_step=self.kv_step,
            )
        except PrefillMemoryExceeded as exc:
            images = ""
            if image_bytes:
                images = f", {format_bytes(image_bytes)} of it to encode its images"
            hint = "send fewer or smaller images, or " + exc.hint if image_bytes else exc.hint
            if one_forward:
                images += ", prefilled in one forward (this model attends the prompt whole)"
                shorter = " or fewer or smaller images" if image_bytes else ""
                hint = (
                    f"send a shorter prompt{shorter}, unload another model, or raise "
                    "memory.max_process_memory (a smaller prefill_step_size does not help: "
                    "the model attends the whole prompt at once)"
                )
            raise PrefillMemoryExceededError(
                f"this prompt ({num_prompt_tokens} tokens) needs about "
                f"{format_bytes(exc.estimated_bytes)} at its prefill peak{images}, over the "
                f"{format_bytes(exc.limit_bytes)} memory limit; {hint}",
                estimated_bytes=exc.estimated_bytes,
                limit_bytes=exc.limit_bytes,
            ) from None
        self._check_capacity(num_prompt_tokens, baseline, held_state_bytes)

    def _check_capacity(self, num_prompt_tokens: int, baseline: int, state_bytes: int) -> None:
        """Refuse a prompt whose cache, alone, passes the KV capacity: its tokens as the
        cache allocates them (grown ``kv_step`` columns at a time, and the first decode
        token: ``allocated_columns``, as admission and preemption count a row) plus a
        hybrid's fixed states and ``state_bytes`` of image states in KV tokens. Conservative:
        a prompt up to a step short of the capacity is refused, though its cache may end
        fewer columns past its tokens."""
        cap = self._capacity(baseline)
        states = -(-state_bytes // max(1, self.dims.kv_bytes_per_token))
        held = allocated_columns(num_prompt_tokens, self.kv_step) + states
        if cap is None or self.kv_tokens(held, 1) <= cap:
            return
        overhead, batch = self.profile.capacity_terms() if self.profile else (0, None)
        # What the capacity was solved from: this prompt's peak (its cache's columns) plus
        # the canary.
        need = canary_bytes(self.limits) + held_tokens_peak_bytes(
            self.limits,
            self.dims,
            tokens=held,
            baseline_bytes=baseline,
            chunk_tokens=self.chunk_tokens,
            overhead_bytes=overhead,
            unmodeled_bytes=self.unmodeled_bytes,
            batch=batch,
        )
        images = ", its image states included" if states else ""
        raise PrefillMemoryExceededError(
            f"this prompt ({num_prompt_tokens} tokens, {held} KV columns as its cache "
            f"grows{images}) needs more KV cache than the {cap} tokens model "
            f"'{self.model}' can hold under the "
            f"{format_bytes(self.limits.hard_bytes)} memory limit beside what is loaded now; "
            "shorten the prompt, unload another model, raise memory.max_process_memory, or "
            "load a smaller model",
            estimated_bytes=need,
            limit_bytes=self.limits.hard_bytes,
        )

    def describe(self) -> str:
        d, lim, p = self.dims, self.limits, self.profile
        profile = "not profiled"
        if p is not None:
            profile = f"max_kv_tokens {p.max_kv_tokens} ({p.source}"
            if p.source == "measured":
                profile += (
                    f": step transient {format_bytes(p.overhead_bytes)}, canary "
                    f"{format_bytes(p.canary_bytes)}, {p.attempts} attempt(s), "
                    f"{p.seconds:.2f} s; {_stressed(p)}"
                )
            profile += ")"
        return (
            f"memguard {self.model}: hard {format_bytes(lim.hard_bytes)}, soft "
            f"{format_bytes(lim.soft_bytes)}, margin "
            f"{format_bytes(lim.transient_margin_bytes)} ({self.margin_source}), baseline "
            f"{format_bytes(self.baseline_bytes)}; dims layers={d.num_layers} "
            f"kv_heads={d.num_kv_heads} head_dim={d.head_dim} heads={d.num_attention_heads}"
            f", KV {d.kv_bytes_per_token} B/token"
            f"{' (measured)' if d.measured_kv_bytes_per_token is not None else ''}"
            f"{_full_kv(d)}{_states(d)}, prefill chunk {self.chunk_tokens}; "
            f"{profile}"
        )


def _full_kv(dims: ModelDims) -> str:
    """The full-precision KV a quantized_kv_start adds to the price (memory/dims.py)."""
    if not dims.full_kv_tokens:
        return ""
    return (
        f" + {dims.full_kv_bytes_per_token} B/token full precision for up to "
        f"{dims.full_kv_tokens} tokens (quantized_kv_start)"
    )


def _states(dims: ModelDims) -> str:
    """A hybrid's fixed states, priced per row beside its tokens."""
    if not dims.state_bytes_per_sequence:
        return ""
    return f" + {format_bytes(dims.state_bytes_per_sequence)} fixed state per sequence"


def _stressed(p: KVProfile) -> str:
    """What the profile's stress ran: measured, extrapolated, or not run."""
    batch = f"batched prefill {p.batch_rows_widest} rows"
    if p.batch_rows_widest <= 1:
        batch = "no batched prefill (one request at a time)"
    elif 1 < p.batch_rows < p.batch_rows_widest:
        batch += f" (extrapolated from {p.batch_rows} measured)"
    else:
        batch += " measured"
    long = "long-context chunk not measured"
    if p.long_context_tokens:
        long = (
            f"a chunk over {p.long_context_tokens} cached tokens measured "
            f"{format_bytes(p.long_context_peak_bytes)} (formulas "
            f"{format_bytes(p.long_context_estimate_bytes)})"
        )
    return f"{batch}, {long}"
