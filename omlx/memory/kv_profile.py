"""What the auto-profile measured (engine/profile.py, profile_stress.py), as the
memory guard, the capacity and the admin API read it. MLX-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVProfile:
    """What the auto-profile measured, and the capacity it chose (admin API)."""

    max_kv_tokens: int
    source: str  # "measured" or "explicit"
    baseline_bytes: int
    # Peaks are bytes added over what was resident before each stress pass.
    prefill_peak_bytes: int = 0
    decode_peak_bytes: int = 0
    # Worst step transient beyond the stress's own KV.
    overhead_bytes: int = 0
    # Of a prefill chunk's transient, what the estimate's formulas do not model.
    unmodeled_bytes: int = 0
    # The transient margin its estimates add: measured x factor ("auto"), or pinned.
    margin_bytes: int = 0
    canary_bytes: int = 0
    attempts: int = 0
    seconds: float = 0.0
    # The batched prefill stress: rows x chunk run as one step (0: not run), its peak.
    batch_rows: int = 0
    batch_peak_bytes: int = 0
    # The widest batched prefill the scheduler may run (max_concurrent_requests rows)
    # and its peak: measured, or extrapolated from ``batch_rows`` when fewer ran.
    batch_rows_widest: int = 0
    batch_widest_peak_bytes: int = 0
    # For the capacity: the widest batch's transient per row beyond its KV, and the
    # worst transient of every other step (0, 0: the capacity counts overhead_bytes whole).
    batch_row_bytes: int = 0
    unbatched_overhead_bytes: int = 0
    # One chunk over this many cached tokens (0: not measured): its peak, and what
    # the formulas say it adds (KV, attention, the grown KV's copy).
    long_context_tokens: int = 0
    long_context_peak_bytes: int = 0
    long_context_estimate_bytes: int = 0
    # KV really allocated (every page written) beside the steps in the passing validation.
    held_kv_bytes: int = 0
    # Resident bytes after the passes were torn down (the baseline when higher).
    teardown_bytes: int = 0
    # A VLM's image pass: one image at the processor's largest size encoded (vision
    # tower, projector, the prompt's embeddings), measured, and the formula's figure.
    image_peak_bytes: int = 0
    image_estimate_bytes: int = 0

    def capacity_terms(self) -> tuple[int, BatchTransient | None]:
        """(overhead, batched step) the capacity is solved with: the batched step
        bounded by the KV in flight when it was measured, else the worst step whole."""
        if self.batched:
            batch = BatchTransient(self.batch_row_bytes, self.batch_rows_widest)
            return self.unbatched_overhead_bytes, batch
        return self.overhead_bytes, None

    @property
    def batched(self) -> bool:
        return bool(self.batch_row_bytes) and self.batch_rows_widest > 1

    @property
    def margin_step_bytes(self) -> int:
        """The step an "auto" margin covers: one request's worst, alone or as one row
        of the batched prefill, whose further rows are priced one by one
        (``row_excess_bytes`` at admission, ``step_excess_bytes`` at the forward gate)."""
        if self.batched:
            return max(self.unbatched_overhead_bytes, self.batch_row_bytes)
        return self.overhead_bytes


@dataclass(frozen=True)
class BatchTransient:
    """The widest batched prefill's transient beyond its KV: ``row_bytes`` a row, up to
    ``rows`` rows. A step is no wider than the chunks the KV in flight makes, so with
    ``tokens`` held it is at most ceil(tokens / chunk) rows: the capacity bounds it."""

    row_bytes: int
    rows: int

    def at(self, tokens: int, chunk_tokens: int) -> int:
        return self.row_bytes * min(self.rows, -(-tokens // chunk_tokens))
