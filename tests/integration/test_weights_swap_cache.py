"""The prefix cache knows a model by its weights' content (issue 41, defect 4).

Another model's weights of exactly the same sizes (another fine-tune of the same
base, a re-download) replace a model's files: after an unload and reload (RAM
tier) or a restart (SSD tier) a long prompt hits none of the old blocks and the
answer is the new weights' own (mlx-lm's greedy tokens). Without the swap, the
same reload and restart do hit: the test would see a stale hit.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from omlx.errors import InsufficientMemoryError
from tests.fixtures.tiny_models import build_tiny_model
from tests.integration.test_memory_admission import MLXProbe, generate

NAME = "swapped"
PROMPT = [5 + (j * 7) % 300 for j in range(200)]
CACHE = {"enabled": True, "block_size": 16}


def _greedy_text(model_dir: Path, n: int) -> str:
    """mlx-lm's own greedy answer of the model in ``model_dir`` (up to its EOS)."""
    model, tokenizer = load(str(model_dir))
    tokens = []
    for token, _ in generate_step(mx.array(PROMPT), model, max_tokens=n):
        if int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    return tokenizer.decode(tokens)


async def _answer(pool) -> tuple[str, int]:
    """The prompt's greedy answer, and the prompt tokens the prefix cache gave it."""
    engine = await pool.get_engine(NAME)
    saved = engine.prefix_cache.stats()["tokens_saved"]
    _, text = await generate(engine, f"r{saved}-{id(engine)}", PROMPT, max_tokens=8)
    return text, engine.prefix_cache.stats()["tokens_saved"] - saved


def _swap(models: Path, new_weights: Path) -> None:
    """Replace the model's weights file by another of the same size, as a copy does."""
    target = models / NAME / "model.safetensors"
    assert target.stat().st_size == new_weights.stat().st_size
    shutil.copyfile(new_weights, target)


def test_same_size_weights_swapped_in_never_hit_the_old_blocks(make_pool, tmp_path: Path) -> None:
    models = tmp_path / "models"
    build_tiny_model(models / NAME, "llama", seed=1)
    other = build_tiny_model(tmp_path / "other", "llama", seed=2)
    old_answer = _greedy_text(models / NAME, 8)
    new_answer = _greedy_text(other, 8)
    assert old_answer != new_answer

    async def reload(pool) -> tuple[str, int]:
        await pool.unload(NAME)
        return await _answer(pool)

    async def ram_tier() -> None:
        pool = make_pool(models, cache=CACHE)
        assert await _answer(pool) == (old_answer, 0)
        # The same weights, reloaded: the old blocks are served.
        text, cached = await reload(pool)
        assert text == old_answer and cached > 0
        _swap(models, other / "model.safetensors")
        assert await reload(pool) == (new_answer, 0)
        await pool.close()

    asyncio.run(ram_tier())

    async def ssd_tier(expected: str, hit: bool) -> None:
        pool = make_pool(models, cache=CACHE)  # a restart: the same data folder
        text, cached = await _answer(pool)
        assert text == expected and (cached > 0) == hit
        await pool.close()

    # Restarts: unchanged weights hit the SSD tier; swapped back, they never do.
    asyncio.run(ssd_tier(new_answer, hit=True))
    build_tiny_model(tmp_path / "again", "llama", seed=1)
    _swap(models, tmp_path / "again" / "model.safetensors")
    asyncio.run(ssd_tier(old_answer, hit=False))


def test_a_failed_load_leaves_the_ram_tier_as_it_was(make_pool, tmp_path: Path) -> None:
    """A load that fails after its prefix cache was made (here its auto-profile: the
    readings say the ceiling is all but reached, ``MLXProbe`` drifted) detaches it
    from the shared RAM tier, so loading the model again fails the same way (507),
    not with "already attached"."""
    models = tmp_path / "models"
    build_tiny_model(models / NAME, "llama", seed=1)
    pool = make_pool(models, cache=CACHE, fresh_profile=True)
    probe = pool.probe = MLXProbe()
    probe.drifted_to = pool.limits.hard_bytes - 1_000_000

    async def main() -> None:
        for _ in range(2):
            with pytest.raises(InsufficientMemoryError):
                await pool.get_engine(NAME)

    asyncio.run(main())
