"""The embedding engine under a tight ceiling (the real MiniLM, the real worker, the
pool's live baseline; readings set by the test as in test_pool.py): an input that
can never fit is a 400 at the front door, one that cannot run only because other
work holds the memory waits for it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from omlx.embeddings.inputs import Sequence
from omlx.engine.stream import RequestStream
from omlx.errors import PrefillMemoryExceededError
from omlx.memory.budget import Limits
from omlx.scheduler import Request, SamplingParams
from tests.integration.test_pool import SetProbe

MINILM = "all-MiniLM-L6-v2"
HELD = 100_000_000  # what the process holds with nothing in flight (a made-up reading)


def sequence(num_tokens: int) -> list[Sequence]:
    ids = [101] + [2023] * (num_tokens - 2) + [102]  # [CLS] this this ... [SEP]
    return [Sequence(ids, [0] * num_tokens)]


@pytest.fixture
def models(tmp_path: Path, minilm_path: Path, tiny_models_dir: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / MINILM).symlink_to(minilm_path)
    (folder / "tiny-llama").symlink_to(tiny_models_dir / "tiny-llama")
    return folder


def test_an_input_that_cannot_fit_alone_is_400_and_one_that_can_waits(make_pool, models) -> None:
    pool = make_pool(fresh_profile=True, model_dir=models, memory={"max_kv_tokens": 4096})
    probe = pool.probe = SetProbe()
    probe.bytes = HELD

    async def main() -> None:
        llama = await pool.get_engine("tiny-llama")  # loads publish the pool's limits
        engine = await pool.get_engine(MINILM)
        await asyncio.sleep(0.2)  # the worker observes the idle baseline after its turn
        guard = engine.guard
        room = guard.step_bytes(1, 16) + guard.limits.transient_margin_bytes + 1_000_000
        guard.publish(Limits(HELD + room, HELD + room, guard.limits.transient_margin_bytes))
        with pytest.raises(PrefillMemoryExceededError) as info:
            engine.submit(sequence(512))
        err = info.value
        assert err.http_status == 400 and err.param == "input"
        assert err.estimated_bytes > err.limit_bytes == HELD + room
        assert "512-token input" in err.message and "max_process_memory" in err.message
        assert engine.num_in_flight == 0
        # Another model's request holds 50 MB: the 16-token input waits, then runs.
        stream = RequestStream("other", asyncio.get_running_loop())
        params = SamplingParams(temperature=0.0, max_tokens=4000)
        llama.submit(Request("other", (5, 6, 7, 8), params), stream)
        while not llama.num_in_flight:
            await asyncio.sleep(0.01)
        probe.bytes = HELD + 50_000_000
        future = engine.submit(sequence(16))
        while not engine.num_deferrals:
            assert not future.done(), future.exception()
            await asyncio.sleep(0.01)
        probe.bytes = HELD
        vectors = await asyncio.wrap_future(future)
        assert vectors.shape == (1, 384) and np.isfinite(vectors).all()
        assert engine.num_gated == 0
        assert llama.num_in_flight == 1  # it was running all along
        llama.abort("other")

    asyncio.run(main())
