"""Issue 40, item 7: a finished request's prefix-cache stores turn its KV into
RAM-tier bytes, so they run before the memory gate reads memory in a step, never
after its reading (the gate would let a step's forward pass on bytes it did not
count)."""

from __future__ import annotations

import asyncio
from typing import Any

from omlx.engine.stream import RequestStream
from omlx.memory.budget import MemoryReading
from omlx.memory.probe import MemoryProbe
from omlx.scheduler import Request, SamplingParams


class StoreWatch(MemoryProbe):
    """A real probe that notes, at each fresh reading on the MLX thread, how many
    blocks the watched prefix cache had stored by then; ``steps`` groups those
    notes by engine step (``watch_steps`` wraps the engine's ``step``)."""

    def __init__(self) -> None:
        super().__init__(max_age_s=0.0)
        self.prefix: Any = None
        # Per step: blocks stored at its start, at each reading, at its end.
        self.steps: list[tuple[int, list[int], int]] = []
        self._readings: list[int] | None = None

    def stored(self) -> int:
        return int(self.prefix.stats()["blocks_stored"]) if self.prefix is not None else 0

    def reading(self, fresh: bool = False) -> MemoryReading:
        if fresh and self._readings is not None:
            self._readings.append(self.stored())
        return super().reading(fresh=fresh)

    def watch_steps(self, engine: Any) -> None:
        self.prefix, step = engine.prefix_cache, engine.step

        def watched() -> None:
            start, self._readings = self.stored(), []
            try:
                step()
            finally:
                self.steps.append((start, self._readings, self.stored()))
                self._readings = None

        engine.step = watched


async def _generate(engine: Any, rid: str, prompt: list[int], max_tokens: int) -> None:
    stream = RequestStream(rid, asyncio.get_running_loop())
    engine.submit(Request(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens)), stream)
    while True:
        event = await stream.get()
        assert event.error is None, event.error
        if event.finish_reason:
            return


def test_a_finished_requests_stores_run_before_the_gate_reads(make_pool) -> None:
    """A short request finishes while a long one decodes on: the short one's
    blocks are stored in a later step, and every reading the gate takes in that
    step already holds them."""

    async def main() -> None:
        pool = make_pool(cache={"enabled": True, "block_size": 16}, fresh_profile=True)
        probe = pool.probe = StoreWatch()
        engine = await pool.get_engine("tiny-llama")
        probe.watch_steps(engine)
        await asyncio.gather(
            _generate(engine, "short", list(range(3, 60)), 4),
            _generate(engine, "long", list(range(70, 130)), 40),
        )
        storing = [(seen, end) for start, seen, end in probe.steps if end > start]
        assert storing, "no step stored blocks"
        stale = [(seen, end) for seen, end in storing if not seen or min(seen) < end]
        assert not stale, f"the gate read before the step's stores: {stale}"

    asyncio.run(main())
