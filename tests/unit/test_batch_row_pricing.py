"""The widest batched prefill is priced per row, not in the margin (issue 40, item 11).

The auto-profile measures (or extrapolates) the widest batched prefill the scheduler
may run. Folding it into the "auto" margin would charge every estimate (a lone
prompt's too) for eight rows at once: the built-in model would not load under a small
ceiling. The margin covers one row's step; each row of a batched step brings what the
formulas miss of its share, in proportion to its chunk's tokens."""

from __future__ import annotations

from omlx.memory.budget import (
    KVProfile,
    Limits,
    MemoryReading,
    measured_margin_bytes,
    prefill_step_transient_bytes,
)
from omlx.memory.dims import ModelDims
from omlx.memory.guard import MemoryGuard

MIB = 2**20
DIMS = ModelDims(num_layers=4, num_kv_heads=2, head_dim=64, num_attention_heads=4, hidden_size=256)
CHUNK = 256
HARD = 4096 * MIB


def _guard(batch_row_bytes: int) -> MemoryGuard:
    auto = Limits(HARD, HARD * 3 // 4, transient_margin_bytes=1024 * MIB, margin_pinned=False)
    guard = MemoryGuard("m", DIMS, limits=auto, baseline=lambda: 500 * MIB, chunk_tokens=CHUNK)
    widest = 8
    guard.set_profile(
        KVProfile(
            max_kv_tokens=10_000,
            source="measured",
            baseline_bytes=500 * MIB,
            overhead_bytes=widest * batch_row_bytes,  # the widest batch is the worst step
            unbatched_overhead_bytes=100 * MIB,
            batch_rows=2,
            batch_rows_widest=widest,
            batch_row_bytes=batch_row_bytes,
            attempts=1,
        )
    )
    return guard


def test_the_auto_margin_covers_one_rows_step_and_each_row_its_excess() -> None:
    guard = _guard(batch_row_bytes=40 * MIB)
    assert guard.limits.transient_margin_bytes == measured_margin_bytes(100 * MIB) == 125 * MIB
    formula = prefill_step_transient_bytes(DIMS, CHUNK, CHUNK)
    assert guard.row_excess_bytes == 40 * MIB - formula


def test_a_row_within_the_formulas_adds_nothing() -> None:
    guard = _guard(batch_row_bytes=prefill_step_transient_bytes(DIMS, CHUNK, CHUNK) // 2)
    assert guard.row_excess_bytes == 0


def test_the_auto_margin_covers_one_row_even_when_a_row_outweighs_the_solo_step() -> None:
    """A row of the batched prefill may hold more than the solo chunk did: one row's
    step, whichever it is, is what the margin covers."""
    guard = _guard(batch_row_bytes=160 * MIB)
    assert guard.limits.transient_margin_bytes == measured_margin_bytes(160 * MIB)


def _peak_in_fact(guard: MemoryGuard, resident: int, rows: int) -> int:
    """What a step of ``rows`` full chunks holds at its peak, as the profile measured
    a row: its chunk's KV and the row's transient beyond it."""
    kv = guard.dims.kv_bytes_per_token * CHUNK
    return resident + rows * (kv + guard.profile.batch_row_bytes)


def test_the_forward_gate_never_lets_a_batched_step_past_the_limit() -> None:
    """At every width, a step the gate lets run holds no more than the hard limit, as
    the profile measured its rows (the margin covers the first, the gate prices the
    others): at the highest resident memory the gate allows, the step still fits."""
    for row_bytes in (40 * MIB, 160 * MIB):
        guard = _guard(batch_row_bytes=row_bytes)
        for rows in range(1, 9):
            highest = _highest_resident_allowed(guard, rows * CHUNK)
            assert _peak_in_fact(guard, highest, rows) <= HARD, (row_bytes, rows)


def _highest_resident_allowed(guard: MemoryGuard, num_tokens: int) -> int:
    def fits(resident: int) -> bool:
        reading = MemoryReading(resident, resident, 0, taken_at_s=0.0)
        return guard.gate(num_tokens, 0, reading, others=False)

    low, high = 0, HARD
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    assert fits(low) and not fits(high)
    return low


def test_one_chunk_pays_no_batch_excess_and_each_further_chunk_a_row() -> None:
    """A step of one chunk is one request's step, which the margin covers: a lone
    prompt's chunk is priced as before the batch was measured. Each further chunk's
    worth of tokens is a row (its transient beyond the KV growth the gate counts), so
    eight rows capped to an eighth of a chunk are priced as one request."""
    guard = _guard(batch_row_bytes=40 * MIB)
    row = 40 * MIB - guard.dims.kv_bytes_per_token * CHUNK
    assert guard.step_excess_bytes(CHUNK) == 0
    assert guard.step_excess_bytes(CHUNK // 8 * 8) == 0
    assert guard.step_excess_bytes(2 * CHUNK) == row
    assert guard.step_excess_bytes(8 * CHUNK) == 7 * row
    # Room for the modeled bytes of four full chunks (KV, growth, attention: a few
    # MB here), the margin, and three further rows: not eight.
    resident = HARD - guard.limits.transient_margin_bytes - 3 * row - 8 * MIB
    reading = MemoryReading(resident, resident, 0, taken_at_s=0.0)
    assert not guard.gate(8 * CHUNK, 0, reading, others=False)
    assert guard.gate(4 * CHUNK, 0, reading, others=False)
    assert guard.gate(CHUNK, 0, reading, others=False)
