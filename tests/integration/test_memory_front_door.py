"""The memory guard's front door on real engines: a prompt that can never fit is
refused before any MLX work; one that fits runs."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from omlx.engine.stream import RequestStream
from omlx.errors import PrefillMemoryExceededError
from omlx.scheduler import Request, SamplingParams


def test_a_prompt_that_can_never_fit_is_refused_before_any_forward_pass(make_pool) -> None:
    pool = make_pool(prefill_step_size=512)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        guard = engine.guard
        # tiny-llama's head_dim (16) has no fused attention kernel: a 3000-token
        # prompt needs a 512 x 3000 x 4-head float score matrix (~24 MiB) at its peak.
        assert guard.dims.head_dim == 16
        ceiling = guard.baseline_bytes + guard.limits.transient_margin_bytes + 8 * 2**20
        guard.publish(
            dataclasses.replace(guard.limits, hard_bytes=ceiling, soft_bytes=int(ceiling * 0.85))
        )
        stream = RequestStream("huge", asyncio.get_running_loop())
        huge = Request("huge", tuple(range(10, 3010)), SamplingParams(0.0, max_tokens=4))
        with pytest.raises(PrefillMemoryExceededError) as info:
            engine.submit(huge, stream)
        err = info.value
        assert err.http_status == 400 and err.code == "prefill_memory_exceeded"
        assert err.estimated_bytes > err.limit_bytes == ceiling
        assert "prefill_step_size" in err.message  # the attention transient dominates
        # Nothing reached the engine: no request in flight, none finished.
        assert engine.num_in_flight == 0 and not engine.finish_counts and not engine.has_work
        # The engine still serves a prompt that fits. Its forward gate reads the process
        # as it is now, and earlier tests in this pytest process move its RSS by more
        # than the 8 MiB above the load-time baseline: give the small prompt its 8 MiB
        # above the current reading (the refusal above used the baseline, as it must).
        now = engine.probe.reading(fresh=True).resident_bytes
        roomy = max(ceiling, now + guard.limits.transient_margin_bytes + 8 * 2**20)
        roomy = int(roomy / 0.98) + 1  # the KV capacity keeps a 2% canary free beside it
        guard.publish(
            dataclasses.replace(guard.limits, hard_bytes=roomy, soft_bytes=int(roomy * 0.85))
        )
        small = RequestStream("small", asyncio.get_running_loop())
        engine.submit(Request("small", (10, 11, 12), SamplingParams(0.0, max_tokens=3)), small)
        while not (event := await small.get()).finished:
            pass
        assert event.finish_reason == "length"

    asyncio.run(main())


def test_the_guard_logs_its_resolved_state_at_load(make_pool, caplog) -> None:
    pool = make_pool()
    with caplog.at_level("INFO"):
        asyncio.run(pool.get_engine("tiny-qwen3"))
    states = [
        r.getMessage()
        for r in caplog.records
        if "memguard tiny-qwen3" in r.getMessage() and "hard" in r.getMessage()
    ]
    assert len(states) == 1
    for part in ("baseline", "margin", "layers=2", "head_dim=16", "512 B/token"):
        assert part in states[0]
