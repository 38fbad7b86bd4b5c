"""Seed 003's rule on the draft-model path: the draft's KV is in every request's
price at the front door, and a speculative step's draft forwards and verified
positions pass the same forward gate as a prefill chunk (refused: the step
decodes without drafts, with the same tokens)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from omlx.errors import PrefillMemoryExceededError
from tests.integration.test_speculative_gate import roomy_then_tight

MODEL = "tiny-llama"
DRAFT: dict[str, Any] = {"method": "draft", "num_tokens": 4, "draft_model": "tiny-llama-twin"}


@pytest.fixture
def models_dir(tiny_models_dir: Path, tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(tiny_models_dir / MODEL, root / MODEL)
    shutil.copytree(tiny_models_dir / MODEL, root / "tiny-llama-twin")
    return root


def test_a_draft_step_over_the_limit_decodes_without_drafts(make_pool, models_dir) -> None:
    async def main() -> None:
        engine, drafted = await roomy_then_tight(
            make_pool(models_dir, fresh_profile=True), MODEL, DRAFT
        )
        assert engine.draft is not None and engine.draft.name == "tiny-llama-twin"
        # The reading rises once the first token reaches the event loop; a step the
        # MLX thread ran before that may still draft (one step: num_tokens drafts).
        assert engine.speculative_stats()["drafted"] <= drafted + DRAFT["num_tokens"]

    asyncio.run(main())


def test_the_front_door_prices_the_drafts_kv(make_pool, models_dir) -> None:
    """A prompt the model alone could hold is refused while a draft model's KV
    doubles every token's price, and fits again once the draft is dropped."""

    async def main() -> None:
        pool = make_pool(models_dir)
        alone = await pool.get_engine(MODEL)
        own_kv = alone.guard.dims.kv_bytes_per_token
        cap_alone = alone.guard.max_kv_tokens
        await pool.unload(MODEL)
        pool.model_settings.update(MODEL, {"speculative": DRAFT})
        engine = await pool.get_engine(MODEL)
        assert engine.guard.dims.kv_bytes_per_token == 2 * own_kv  # the twin's KV too
        cap = engine.guard.max_kv_tokens
        assert cap is not None and cap_alone is not None and cap < cap_alone
        with pytest.raises(PrefillMemoryExceededError):
            engine.guard.check_prefill(cap + 1)
        pool.model_settings.update(MODEL, {"speculative": None})
        await pool.settings_changed(MODEL)  # returns once the draft is dropped
        assert engine.draft is None and engine.guard.dims.kv_bytes_per_token == own_kv
        engine.guard.check_prefill(cap + 1)

    asyncio.run(main())
