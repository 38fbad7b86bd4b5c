"""A model that cannot batch serves its requests one at a time (issue 41, defect 1),
with a real tiny gpt_bigcode: mlx-lm's own model file raises when several requests
share a step ("Only length-1 arrays can be converted to Python scalars"), each alone
works. Four requests at once all complete with their solo answers; the model is
marked one-at-a-time with the reason (/health's ``batching``) and stays so."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from omlx.engine.engine_status import engine_status
from tests.fixtures.tiny_models import build_tiny_model
from tests.integration.test_memory_admission import generate


@pytest.fixture(scope="module")
def bigcode_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unbatched")
    build_tiny_model(root / "bigcode", "gpt_bigcode")
    return root


def test_a_model_that_cannot_batch_serves_four_at_once_one_at_a_time(
    make_pool, bigcode_dir: Path
) -> None:
    pool = make_pool(bigcode_dir, max_concurrent_requests=8)
    prompts = [[5 + (i * 7 + j) % 300 for j in range(40 + 10 * i)] for i in range(4)]

    async def main() -> None:
        engine = await pool.get_engine("bigcode")
        solo = [await generate(engine, f"solo-{i}", p, 12) for i, p in enumerate(prompts)]
        assert engine_status(engine)["batching"] == {"one_at_a_time": False, "reason": None}
        for round_ in range(2):
            together = await asyncio.gather(
                *(generate(engine, f"r{round_}-{i}", p, 12) for i, p in enumerate(prompts))
            )
            assert together == solo
        batching = engine_status(engine)["batching"]
        assert batching["one_at_a_time"] and "a batch of" in batching["reason"]
        assert "Only length-1 arrays" in batching["reason"]
        assert engine.finish_counts["error"] == 0

    asyncio.run(main())
