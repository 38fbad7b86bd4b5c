"""Issue 40, item 5: a row that joins the decode batch during a step (here a lone
request moving from its solo prefill into the batch to draft) was not in the
speculation plan the gate passed, so its draft model's catch-up forward and its
verified positions must wait for the next plan: under a ceiling that refuses
them, the draft model never runs and the tokens are the plain greedy ones."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from omlx.engine.stream import RequestStream
from omlx.memory.budget import Limits, MemoryReading
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.frozen_probe import FrozenProbe

MODEL = "tiny-llama"
DRAFT: dict[str, Any] = {"method": "draft", "num_tokens": 4, "draft_model": "tiny-llama-twin"}
PROMPT = list(range(3, 40)) * 3  # 111 tokens: the draft's catch-up is the whole history
MB = 1_000_000
GREEDY = SamplingParams(temperature=0.0, max_tokens=30)


@pytest.fixture
def models_dir(tiny_models_dir: Path, tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(tiny_models_dir / MODEL, root / MODEL)
    shutil.copytree(tiny_models_dir / MODEL, root / "tiny-llama-twin")
    return root


async def _text(engine: Any, rid: str) -> str:
    stream = RequestStream(rid, asyncio.get_running_loop())
    engine.submit(Request(rid, tuple(PROMPT), GREEDY), stream)
    return await _collect(stream)


async def _collect(stream: RequestStream) -> str:
    text = ""
    while True:
        event = await stream.get()
        assert event.error is None, event.error
        text += event.text
        if event.finish_reason:
            return text


def _tight_limits(engine: Any, held: int) -> Limits:
    """The lowest ceiling under which a 32-token chunk over 128 cached tokens fits
    (the request's prefill after its cache hit) with ``held`` bytes held."""
    reading = MemoryReading(held, held, held, taken_at_s=0.0)

    def fits(hard: int, tokens: int, cached: int) -> bool:
        engine.guard.publish(Limits(hard, hard, 64 * MB, margin_pinned=True))
        return bool(engine.guard.gate(tokens, cached, reading, others=False))

    low, high = held, held + 10_000 * MB
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid, 32, 128) else (mid, high)
    assert not fits(high, 100, 100), "the ceiling would pass the catch-up"
    return Limits(high, high, 64 * MB, margin_pinned=True)


def test_a_draft_row_joining_mid_step_waits_for_the_gate(make_pool, models_dir) -> None:
    async def main() -> None:
        pool = make_pool(models_dir, cache={"enabled": True, "block_size": 16}, fresh_profile=True)
        probe = pool.probe = FrozenProbe()
        pool.model_settings.update(MODEL, {"speculative": DRAFT})
        engine = await pool.get_engine(MODEL)
        assert engine.draft is not None
        num_draft, engine.num_draft = engine.num_draft, 0
        plain = await _text(engine, "plain")  # greedy without drafts; stores the prompt
        engine.num_draft = num_draft
        assert await _text(engine, "roomy") == plain
        drafted = engine.speculative_stats()["drafted"]
        assert drafted > 0

        # Tight from admission on: the request restores its hit, prefills the
        # rest alone, then joins the batch to draft: its catch-up never fits.
        hold = threading.Event()
        pool.worker.post(hold.wait)
        stream = RequestStream("tight", asyncio.get_running_loop())
        engine.submit(Request("tight", tuple(PROMPT), GREEDY), stream)
        probe.held = probe.reading().resident_bytes
        pool.limits = _tight_limits(engine, probe.held)
        engine.guard.publish(pool.limits)
        hold.set()
        assert await _collect(stream) == plain
        stats = engine.speculative_stats()
        assert stats["drafted"] == drafted  # the draft model proposed nothing
        assert engine.gate.num_held_drafts > 0 and engine.num_gated == 0

    asyncio.run(main())
