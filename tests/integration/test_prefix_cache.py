"""The prefix cache wired into the engine, on real tiny models (dense, hybrid, and
sliding-window: tiny-gemma3's 32-token windows wrap on every prompt here).

Greedy output must be the same whether the prompt's prefix was computed now or
restored from the RAM tier or, after a restart, from the SSD tier.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from omlx.engine.model_engine import ModelEngine
from omlx.engine.stream import RequestStream
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.tiny_models import build_tiny_model

_ids = itertools.count()
BLOCK = 16
CACHE = {"enabled": True, "block_size": BLOCK, "hot_cache_max_size": "256MB"}

MODELS = ["tiny-llama", "tiny-lfm2", "tiny-gemma3"]
WINDOW = 32  # tiny-gemma3's sliding window

CONVERSATION = (
    "The memory of the machine is shared between the processor and the graphics unit. "
    "When one request fills it, every other program on the machine feels it. "
)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache-models")
    build_tiny_model(root / "tiny-llama", "llama", seed=0)
    build_tiny_model(root / "tiny-lfm2", "lfm2", seed=3)
    build_tiny_model(root / "tiny-gemma3", "gemma3_text", seed=4)
    return root


async def generate(engine: ModelEngine, ids: list[int], max_tokens: int = 12) -> tuple[str, int]:
    """(text, prompt tokens served from the cache) of one greedy request."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    stream = RequestStream(f"req-{next(_ids)}", asyncio.get_running_loop())
    engine.submit(Request(stream.request_id, tuple(ids), params), stream)
    text, cached = "", 0
    while True:
        event = await stream.get()
        assert event is not None and event.error is None, event
        text += event.text
        cached = max(cached, event.num_cached_tokens)
        if event.finish_reason:
            return text, cached


async def settle(engine: ModelEngine) -> None:
    """Let the worker run the stores it defers to the step after a request."""
    for _ in range(50):
        if not engine.has_work:
            return
        await asyncio.sleep(0.02)


def encode(engine: ModelEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text))


@pytest.mark.parametrize("model", MODELS)
def test_hit_gives_the_cold_output(make_pool, models_dir: Path, model: str) -> None:
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=32)

    async def main() -> None:
        engine = await pool.get_engine(model)
        prompt = encode(engine, CONVERSATION * 2)
        assert len(prompt) > 4 * BLOCK
        cold, cached = await generate(engine, prompt)
        assert cached == 0
        await settle(engine)
        warm, cached = await generate(engine, prompt)
        assert warm == cold
        # Every prompt token but the last (whose logits start the answer).
        assert cached == len(prompt) - 1
        stats = engine.prefix_cache.stats()
        assert stats["hits"] == 1 and stats["tokens_saved"] == len(prompt) - 1

    asyncio.run(main())


@pytest.mark.parametrize("model", MODELS)
def test_conversation_hits_every_previous_turn(make_pool, models_dir: Path, model: str) -> None:
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=32)

    async def main() -> None:
        engine = await pool.get_engine(model)
        history: list[int] = []
        previous = 0
        for turn in range(3):
            history += encode(engine, f"Turn {turn}: " + CONVERSATION)
            answer, cached = await generate(engine, history)
            await settle(engine)
            # At least every full block of the previous turns' prompt.
            assert cached >= previous // BLOCK * BLOCK
            previous = len(history)
            # The same conversation computed from nothing gives the same answer.
            engine.prefix_cache._hot.clear(tier="hot")
            cold, cold_cached = await generate(engine, history)
            assert (cold, cold_cached) == (answer, 0)
            await settle(engine)

    asyncio.run(main())


@pytest.mark.parametrize("model", MODELS)
def test_hits_while_batching(make_pool, models_dir: Path, model: str) -> None:
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=32)

    async def main() -> None:
        engine = await pool.get_engine(model)
        shared = encode(engine, CONVERSATION)
        prompts = [shared + encode(engine, f" Question {i}: what now?") for i in range(4)]
        cold = [await generate(engine, p) for p in prompts]
        await settle(engine)
        engine.prefix_cache._hot.clear(tier="hot")
        await generate(engine, shared + encode(engine, " warm up"))
        await settle(engine)
        # Four at once: the batch path restores the shared prefix for each.
        together = await asyncio.gather(*(generate(engine, p) for p in prompts))
        assert [t for t, _ in together] == [t for t, _ in cold]
        assert all(c >= len(shared) // BLOCK * BLOCK for _, c in together)

    asyncio.run(main())


@pytest.mark.parametrize("model", ["tiny-lfm2", "tiny-gemma3"])
def test_unsliceable_prompts_prefilled_in_a_batch_are_stored(
    make_pool, models_dir: Path, model: str
) -> None:
    """Recurrent state and wrapped windows cannot be cut later: prompts that arrive
    together are prefilled with a snapshot at every block boundary, then decode
    in the batch (rotating windows become BatchRotatingKVCache there)."""
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=32)

    async def main() -> None:
        engine = await pool.get_engine(model)
        prompts = [encode(engine, f"Question {i}. " + CONVERSATION * 2) for i in range(3)]
        assert min(map(len, prompts)) > 2 * WINDOW
        solo = [await generate(engine, p) for p in prompts]
        engine.prefix_cache._hot.clear(tier="hot")
        await settle(engine)
        together = await asyncio.gather(*(generate(engine, p) for p in prompts))
        assert together == [(text, 0) for text, _ in solo]
        await settle(engine)
        for prompt, (text, _) in zip(prompts, solo, strict=True):
            assert await generate(engine, prompt) == (text, len(prompt) - 1)

    asyncio.run(main())


@pytest.mark.parametrize("model", MODELS)
def test_restart_serves_from_ssd(make_pool, models_dir: Path, model: str) -> None:
    async def run(expect_hit: bool) -> tuple[str, int, dict]:
        pool = make_pool(models_dir, cache=CACHE)
        engine = await pool.get_engine(model)
        prompt = encode(engine, CONVERSATION * 2)
        assert len(prompt) > 2 * WINDOW
        text, cached = await generate(engine, prompt)
        await settle(engine)
        stats = engine.prefix_cache.stats()
        await pool.close()  # write-back: RAM blocks go to the SSD on unload
        return text, cached, stats

    cold, cached, _ = asyncio.run(run(False))
    assert cached == 0
    warm, cached, stats = asyncio.run(run(True))
    assert warm == cold
    assert cached > 0
    assert stats["ssd"]["hits"] > 0


@pytest.mark.parametrize("extra", [1, 2])
def test_window_full_at_a_boundary_hit_gives_the_cold_output(
    make_pool, models_dir: Path, extra: int
) -> None:
    """The window is exactly full at token 2 * BLOCK == WINDOW, so the next tokens
    are written into it in place: the stored window must be the one at the
    boundary, not what decoding made of it afterwards."""
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=32)

    async def main() -> None:
        engine = await pool.get_engine("tiny-gemma3")
        assert 2 * BLOCK == WINDOW
        prompt = encode(engine, CONVERSATION)[: WINDOW + extra]
        cold, _ = await generate(engine, prompt, max_tokens=16)
        await settle(engine)
        warm, cached = await generate(engine, prompt, max_tokens=16)
        assert (warm, cached) == (cold, len(prompt) - 1)

    asyncio.run(main())


@pytest.mark.parametrize("model", ["tiny-lfm2", "tiny-gemma3"])
def test_snapshots_do_not_pile_up_during_a_long_prefill(
    make_pool, models_dir: Path, model: str
) -> None:
    """A boundary snapshot (a recurrent state, or a whole window per layer) lives in
    RAM outside every budget until its block is stored: each block is stored as its
    snapshot is taken, so a long prompt never holds more than the newest one."""
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=32)

    async def main() -> None:
        engine = await pool.get_engine(model)
        prefix = engine.prefix_cache
        assert prefix is not None
        held: list[int] = []  # snapshots already held when a new one is taken
        stored: list[int] = []  # blocks stored by then
        take = prefix.snapshot

        def spy(request_id: str, position: int, layers: list) -> None:
            held.append(len(prefix.snapshot_positions(request_id)))
            stored.append(prefix.stats()["blocks_stored"])
            take(request_id, position, layers)

        prefix.snapshot = spy  # type: ignore[method-assign]
        prompt = encode(engine, CONVERSATION * 3)
        assert len(prompt) > 8 * BLOCK
        cold, _ = await generate(engine, prompt)
        assert len(held) >= 8 and max(held) == 0
        # Block n was in the cache before the snapshot at the end of block n + 1.
        assert stored == list(range(len(stored)))
        await settle(engine)
        warm, cached = await generate(engine, prompt)
        assert (warm, cached) == (cold, len(prompt) - 1)

    asyncio.run(main())


def test_a_prompt_sharing_part_of_a_block_reuses_those_tokens(make_pool, models_dir: Path) -> None:
    """Prompts that share a chat template's opening (shorter than a block) or part of
    a block reuse exactly the shared tokens, with the same output as computed cold."""
    cached_pool = make_pool(models_dir, cache=CACHE, prefill_step_size=32)
    plain_pool = make_pool(models_dir)

    async def main() -> None:
        engine = await cached_pool.get_engine("tiny-llama")
        plain = await plain_pool.get_engine("tiny-llama")
        first = encode(engine, CONVERSATION)
        assert len(first) > 2 * BLOCK + 12
        shared = 2 * BLOCK + 11  # two full blocks and 11 tokens of the tail
        second = first[:shared] + encode(engine, " Which one is it?")
        assert second[shared] != first[shared]
        await generate(engine, first)
        await settle(engine)
        cold, cached = await generate(plain, second)
        assert cached == 0
        warm, cached = await generate(engine, second)
        assert (warm, cached) == (cold, shared)

    asyncio.run(main())
