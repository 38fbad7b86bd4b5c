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


def test_the_forward_gate_prices_each_rows_excess_by_its_chunk_tokens() -> None:
    """Eight rows' full chunks bring eight rows' measured excess (40 MB a row here,
    beyond the formulas); the same eight rows capped to an eighth of a chunk bring one
    row's, so capping the chunks is what lets a tight step run."""
    guard = _guard(batch_row_bytes=40 * MIB)
    excess = guard.row_excess_bytes
    assert guard.batch_excess_bytes(8 * CHUNK) == 8 * excess
    assert guard.batch_excess_bytes(CHUNK // 8 * 8) == excess
    # Room for the modeled bytes of eight full chunks (KV, growth, attention: a few
    # MB here) and the margin, plus four rows' excess: not eight.
    resident = HARD - guard.limits.transient_margin_bytes - 4 * excess - 8 * MIB
    reading = MemoryReading(resident, resident, 0, taken_at_s=0.0)
    assert not guard.gate(8 * CHUNK, 0, reading, others=False)
    assert guard.gate(4 * CHUNK, 0, reading, others=False)
    assert guard.gate(CHUNK, 0, reading, others=False)
