"""One model's memory guard: the front-door preflight every engine path runs.

Limits are published as one immutable object (a reference swap), so a model
loaded after start is guarded as soon as it has a guard.
"""

from __future__ import annotations

import logging

from omlx.errors import PrefillMemoryExceededError, SettingsError
from omlx.memory.budget import (
    KVProfile,
    Limits,
    MemoryReading,
    ModelDims,
    PrefillMemoryExceeded,
    admit,
    canary_bytes,
    estimate_prefill,
    gate,
    kv_capacity_tokens,
    preflight,
    resolve_limits,
)
from omlx.settings import MemorySettings
from omlx.sizes import format_bytes, parse_byte_size

log = logging.getLogger(__name__)


def memory_limits(settings: MemorySettings, total_ram_bytes: int) -> Limits:
    """The hard/soft limits from settings; SettingsError naming the field if invalid."""
    try:
        margin = parse_byte_size(
            settings.prefill_transient_margin, field="memory.prefill_transient_margin"
        )
        return resolve_limits(
            settings.max_process_memory,
            total_ram_bytes=total_ram_bytes,
            soft_fraction=settings.soft_fraction,
            transient_margin_bytes=margin,
        )
    except ValueError as exc:
        raise SettingsError(f"invalid memory setting: {exc}") from None


class MemoryGuard:
    def __init__(
        self, model: str, dims: ModelDims, *, limits: Limits, baseline_bytes: int, chunk_tokens: int
    ):
        self.model = model
        self.dims = dims
        self.limits = limits
        # Process memory with this model loaded and nothing in flight.
        self.baseline_bytes = baseline_bytes
        self.chunk_tokens = chunk_tokens
        # Set once the load-time auto-profile (or an explicit max_kv_tokens) ran.
        self.profile: KVProfile | None = None

    def set_profile(self, profile: KVProfile) -> None:
        self.profile = profile
        self.baseline_bytes = max(self.baseline_bytes, profile.baseline_bytes)

    @property
    def unmodeled_bytes(self) -> int:
        return self.profile.unmodeled_bytes if self.profile is not None else 0

    @property
    def max_kv_tokens(self) -> int | None:
        """The KV capacity: explicit, or recomputed from the measured transient
        under the limits in force now (they change with settings)."""
        p = self.profile
        if p is None or p.source == "explicit":
            return p.max_kv_tokens if p is not None else None
        return kv_capacity_tokens(
            self.limits,
            baseline_bytes=self.baseline_bytes,
            overhead_bytes=p.overhead_bytes,
            canary_bytes=canary_bytes(self.limits),
            kv_bytes_per_token=self.dims.kv_bytes_per_token,
            attempt=p.attempts - 1,
        )

    def kv_fits(self, num_tokens_in_flight: int, num_new_tokens: int) -> bool:
        """Admission by KV capacity: the running requests' tokens plus this prompt."""
        cap = self.max_kv_tokens
        return cap is None or num_tokens_in_flight + num_new_tokens <= cap

    def publish(self, limits: Limits) -> None:
        self.limits = limits

    def admit(self, num_prompt_tokens: int, num_in_flight: int, reading: MemoryReading) -> bool:
        """Scheduler admission: False keeps the request queued (re-checked next step).
        Logs each deferral (``memadmit``)."""
        estimate = estimate_prefill(
            self.dims,
            reading,
            num_new_tokens=num_prompt_tokens,
            num_cached_tokens=0,
            chunk_tokens=self.chunk_tokens,
            limits=self.limits,
            others_in_flight=num_in_flight > 0,
            unmodeled_bytes=self.unmodeled_bytes,
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
        """Forward gate: may the next prefill chunk run under the hard limit?"""
        return gate(
            self.dims,
            reading,
            chunk_tokens=chunk_tokens,
            num_cached_tokens=num_cached_tokens,
            limits=self.limits,
            others_in_flight=others,
            unmodeled_bytes=self.unmodeled_bytes,
        )

    def check_prefill(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> None:
        """Raise PrefillMemoryExceededError (HTTP 400) for a prompt that cannot fit
        under the hard limit even with nothing else in flight."""
        cap = self.max_kv_tokens
        if cap is not None and num_prompt_tokens > cap:
            kv = self.dims.kv_bytes_per_token * num_prompt_tokens
            raise PrefillMemoryExceededError(
                f"this prompt ({num_prompt_tokens} tokens) needs more KV cache than the "
                f"{cap} tokens model '{self.model}' can hold under the "
                f"{format_bytes(self.limits.hard_bytes)} memory limit; shorten the prompt, "
                "raise memory.max_process_memory, or load a smaller model",
                estimated_bytes=self.baseline_bytes + kv,
                limit_bytes=self.limits.hard_bytes,
            )
        try:
            preflight(
                self.dims,
                baseline_bytes=self.baseline_bytes,
                num_new_tokens=num_prompt_tokens - num_cached_tokens,
                num_cached_tokens=num_cached_tokens,
                chunk_tokens=self.chunk_tokens,
                limits=self.limits,
                unmodeled_bytes=self.unmodeled_bytes,
            )
        except PrefillMemoryExceeded as exc:
            raise PrefillMemoryExceededError(
                f"this prompt ({num_prompt_tokens} tokens) needs about "
                f"{format_bytes(exc.estimated_bytes)} at its prefill peak, over the "
                f"{format_bytes(exc.limit_bytes)} memory limit; {exc.hint}",
                estimated_bytes=exc.estimated_bytes,
                limit_bytes=exc.limit_bytes,
            ) from None

    def describe(self) -> str:
        d, lim, p = self.dims, self.limits, self.profile
        profile = "not profiled"
        if p is not None:
            profile = f"max_kv_tokens {p.max_kv_tokens} ({p.source}"
            if p.source == "measured":
                profile += (
                    f": step transient {format_bytes(p.overhead_bytes)}, canary "
                    f"{format_bytes(p.canary_bytes)}, {p.attempts} attempt(s), "
                    f"{p.seconds:.2f} s"
                )
            profile += ")"
        return (
            f"memguard {self.model}: hard {format_bytes(lim.hard_bytes)}, soft "
            f"{format_bytes(lim.soft_bytes)}, margin "
            f"{format_bytes(lim.transient_margin_bytes)}, baseline "
            f"{format_bytes(self.baseline_bytes)}; dims layers={d.num_layers} "
            f"kv_heads={d.num_kv_heads} head_dim={d.head_dim} heads={d.num_attention_heads}"
            f", KV {d.kv_bytes_per_token} B/token, prefill chunk {self.chunk_tokens}; "
            f"{profile}"
        )
