"""Seed 003's rule on the speculative path: a speculative step's verified
positions pass the same forward gate as a prefill chunk. Refused, the step
decodes without drafts (never ended): the same tokens, no drafts verified."""

from __future__ import annotations

import asyncio
from typing import Any

from omlx.engine.stream import RequestStream
from omlx.memory.budget import Limits
from omlx.memory.probe import MemoryProbe
from omlx.scheduler import Request, SamplingParams

MB = 1_000_000
MARGIN = 64 * MB
ROOM = 200 * MB
# Repeats itself: the tiny model's greedy output repeats it too, and drafts are kept.
PROMPT = list(range(3, 40)) * 3


class RaisedProbe(MemoryProbe):
    """Real MLX readings (no process footprint) plus ``extra`` bytes: memory that
    other work took since the request started."""

    def __init__(self) -> None:
        super().__init__(max_age_s=0.0)
        self.extra = 0

    def _sample(self) -> tuple[int, int, int]:
        active, _, peak = super()._sample()
        return active + self.extra, active + self.extra, peak + self.extra


async def _tokens(engine, rid: str, probe: RaisedProbe, extra_after_first: int) -> list[str]:
    """The streamed text pieces; after the first, the reading rises by ``extra_after_first``."""
    stream = RequestStream(rid, asyncio.get_running_loop())
    params = SamplingParams(temperature=0.0, max_tokens=40)
    engine.submit(Request(rid, tuple(PROMPT), params), stream)
    pieces: list[str] = []
    while True:
        event = await stream.get()
        assert event.error is None, event.error
        pieces.append(event.text)
        probe.extra = extra_after_first
        if event.finish_reason:
            probe.extra = 0
            return pieces


async def roomy_then_tight(pool, model: str, speculative: dict) -> tuple[Any, int]:
    """A request with room to speculate, then the same request once other work
    took the room after its first token: the engine, and the drafts of the first.
    The text is the same; the gate held drafts in the second."""
    probe = pool.probe = RaisedProbe()
    pool.model_settings.update(model, {"speculative": speculative})
    engine = await pool.get_engine(model)
    baseline = probe.reading(fresh=True).resident_bytes
    pool.limits = Limits(baseline + MARGIN + ROOM, baseline + MARGIN + ROOM, MARGIN)
    engine.guard.publish(pool.limits)

    roomy = "".join(await _tokens(engine, "roomy", probe, 0))
    drafted = engine.speculative_stats()["drafted"]
    assert drafted > 0 and engine.gate.num_held_drafts == 0

    # After the prompt is in, other work takes the room: the gate refuses every
    # speculative step; the request still finishes with the same text.
    tight = "".join(await _tokens(engine, "tight", probe, ROOM))
    assert tight == roomy
    assert engine.gate.num_held_drafts > 0
    assert engine.guard_counters()["held_drafts"] == engine.gate.num_held_drafts
    return engine, drafted


def test_a_speculative_step_over_the_limit_decodes_without_drafts(make_pool) -> None:
    async def main() -> None:
        engine, drafted = await roomy_then_tight(
            make_pool(fresh_profile=True), "tiny-llama", {"method": "ngram"}
        )
        assert engine.speculative_stats()["drafted"] == drafted

    asyncio.run(main())
