"""The batched engine on real (tiny, random) mlx-lm models."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from omlx.engine.model_engine import ModelEngine
from omlx.engine.stream import RequestStream
from omlx.scheduler import Request, SamplingParams

_ids = itertools.count()

PROMPTS = [
    "hello there",
    "What is the capital of France?",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "Once upon a time there was a small model that wanted to be helpful. " * 6,
    "café naïve Zürich 日本語 🙂🚀",
    "def greet(name):\n    return f'Hello, {name}!'",
    "The quick brown fox jumps over the lazy dog." * 3,
    "Memory is shared between the processor and the graphics unit",
]


async def generate(engine: ModelEngine, prompt: str, **sampling) -> tuple[str, str, int]:
    """(text, finish_reason, num_output_tokens) for one request."""
    params = SamplingParams(
        **{"temperature": 0.0, **sampling},
        stop_token_ids=frozenset(engine.loaded.eos_token_ids),
    )
    ids = tuple(engine.tokenizer.encode(prompt))
    stream = RequestStream(f"req-{next(_ids)}", asyncio.get_running_loop())
    engine.submit(Request(stream.request_id, ids, params), stream)
    text = ""
    while True:
        event = await stream.get()
        assert event is not None and event.error is None, event
        text += event.text
        if event.finish_reason:
            return text, event.finish_reason, event.num_output_tokens


def _cases() -> list[tuple[str, int]]:
    return [(p, 6 + 5 * i) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_greedy_batched_output_equals_solo(make_pool, model: str) -> None:
    # A small prefill step makes the long prompts prefill in several chunks
    # while other requests decode.
    pool = make_pool(max_concurrent_requests=8, prefill_step_size=16)

    async def main() -> None:
        engine = await pool.get_engine(model)
        solo = [await generate(engine, p, max_tokens=n) for p, n in _cases()]
        together = await asyncio.gather(*(generate(engine, p, max_tokens=n) for p, n in _cases()))
        assert list(together) == solo
        # Requests joining while others are mid-decode (continuous batching).
        first = [asyncio.create_task(generate(engine, p, max_tokens=n)) for p, n in _cases()[:4]]
        await asyncio.sleep(0.05)
        later = [generate(engine, p, max_tokens=n) for p, n in _cases()[4:]]
        staggered = await asyncio.gather(*first, *later)
        assert list(staggered) == solo
        for (_, reason, n_out), (_, max_tokens) in zip(solo, _cases(), strict=True):
            assert reason == "length" and n_out == max_tokens

    asyncio.run(main())


def test_more_requests_than_slots_all_complete_in_order_of_arrival(make_pool) -> None:
    pool = make_pool(max_concurrent_requests=2, prefill_step_size=64)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        solo = [await generate(engine, p, max_tokens=8) for p in PROMPTS]
        together = await asyncio.gather(*(generate(engine, p, max_tokens=8) for p in PROMPTS))
        assert list(together) == solo
        assert engine.num_in_flight == 0

    asyncio.run(main())


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(make_pool) -> None:
    pool = make_pool()

    async def main() -> None:
        engine = await pool.get_engine("tiny-qwen3")
        opts = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 24}
        alone = await generate(engine, PROMPTS[0], **opts)
        again = await generate(engine, PROMPTS[0], **opts)
        batch = await asyncio.gather(
            generate(engine, PROMPTS[0], **opts),
            generate(engine, PROMPTS[1], temperature=1.0, max_tokens=24),
            generate(engine, PROMPTS[2], temperature=0.0, max_tokens=24),
        )
        assert alone == again == batch[0]
        other_seed = await generate(engine, PROMPTS[0], **{**opts, "seed": 99})
        assert other_seed[0] != alone[0]

    asyncio.run(main())


def test_abort_frees_the_slot_and_the_engine_keeps_serving(make_pool) -> None:
    pool = make_pool(max_concurrent_requests=1)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        expected = await generate(engine, PROMPTS[1], max_tokens=10)
        loop = asyncio.get_running_loop()
        ids = tuple(engine.tokenizer.encode(PROMPTS[0]))
        stream = RequestStream("long-one", loop)
        engine.submit(Request("long-one", ids, SamplingParams(max_tokens=100_000)), stream)
        first = await stream.get()
        assert first is not None and first.num_output_tokens >= 1
        engine.abort("long-one")
        # The only slot is free again: a new request runs to completion.
        assert await asyncio.wait_for(generate(engine, PROMPTS[1], max_tokens=10), 30) == expected
        assert engine.num_in_flight == 0

    asyncio.run(main())


def test_stop_strings_and_stop_token_ids_end_generation(make_pool) -> None:
    pool = make_pool()

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        full, _, _ = await generate(engine, PROMPTS[2], max_tokens=40)
        stop = full[10:14]
        cut = full.index(stop)
        text, reason, _ = await generate(engine, PROMPTS[2], max_tokens=40, stop=(stop,))
        assert (text, reason) == (full[:cut], "stop")

        # Every token is a stop token: the first one ends the request, is counted
        # in the usage, and is never shown as text.
        vocab = engine.loaded.config["vocab_size"]
        params = SamplingParams(0.0, max_tokens=40, stop_token_ids=frozenset(range(vocab)))
        stream = RequestStream("all-stop", asyncio.get_running_loop())
        engine.submit(
            Request("all-stop", tuple(engine.tokenizer.encode(PROMPTS[2])), params), stream
        )
        event = await stream.get()
        assert event is not None
        assert (event.text, event.finish_reason, event.num_output_tokens) == ("", "stop", 1)

    asyncio.run(main())


async def _first_tokens_then(engine: ModelEngine, prompt: str, n_first: int, others, **kw):
    """Run ``prompt`` alone until it streamed ``n_first`` tokens, then add ``others``."""
    params = SamplingParams(
        **{"temperature": 0.0, **kw}, stop_token_ids=frozenset(engine.loaded.eos_token_ids)
    )
    stream = RequestStream(f"lead-{next(_ids)}", asyncio.get_running_loop())
    engine.submit(
        Request(stream.request_id, tuple(engine.tokenizer.encode(prompt)), params), stream
    )
    text, joined, tasks = "", False, []
    while True:
        event = await stream.get()
        assert event is not None and event.error is None
        text += event.text
        if not joined and event.num_output_tokens >= n_first:
            joined = True
            tasks = [asyncio.create_task(generate(engine, p, max_tokens=m)) for p, m in others]
        if event.finish_reason:
            return (text, event.finish_reason, event.num_output_tokens), await asyncio.gather(
                *tasks
            )


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_a_lone_request_keeps_its_output_when_others_join_mid_decode(make_pool, model) -> None:
    # A lone request decodes unbatched; when others arrive it moves into the batch
    # with its cache and sampler, and nothing about its output changes.
    pool = make_pool(prefill_step_size=16)

    async def main() -> None:
        engine = await pool.get_engine(model)
        others = [(p, 12) for p in PROMPTS[1:4]]
        lead_alone = await generate(engine, PROMPTS[3], max_tokens=40)
        others_alone = [await generate(engine, p, max_tokens=m) for p, m in others]
        for n_first in (1, 5, 20):
            lead, rest = await _first_tokens_then(
                engine, PROMPTS[3], n_first, others, max_tokens=40
            )
            assert lead == lead_alone and list(rest) == others_alone
        seeded = {"temperature": 1.0, "seed": 7, "max_tokens": 30}
        alone = await generate(engine, PROMPTS[0], **seeded)
        lead, _ = await _first_tokens_then(engine, PROMPTS[0], 10, others, **seeded)
        assert lead == alone
        assert engine.num_in_flight == 0

    asyncio.run(main())


def test_a_lone_request_joins_the_batch_mid_prefill(make_pool) -> None:
    pool = make_pool(prefill_step_size=16)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        long_prompt = PROMPTS[3] * 8  # many 16-token chunks
        expected = await generate(engine, long_prompt, max_tokens=10)
        short_alone = await generate(engine, PROMPTS[0], max_tokens=10)
        first = asyncio.create_task(generate(engine, long_prompt, max_tokens=10))
        await asyncio.sleep(0.005)  # a few prefill chunks in
        second = await generate(engine, PROMPTS[0], max_tokens=10)
        assert await first == expected and second == short_alone

    asyncio.run(main())


def test_a_burst_reaching_an_idle_engine_starts_as_one_batch(make_pool) -> None:
    """Requests arriving within the burst window of each other start together: the
    first one's first token comes only after the last one arrived. (A window far
    longer than a tiny model's first token: without gathering, the first request
    would have its first token before the second is even sent.) Their outputs are
    what each gives alone."""
    pool = make_pool(max_concurrent_requests=8, burst_window_ms=400, burst_max_ms=5000)

    async def first_token_time(engine: ModelEngine, prompt: str) -> tuple[float, str]:
        params = SamplingParams(
            temperature=0.0, max_tokens=6, stop_token_ids=frozenset(engine.loaded.eos_token_ids)
        )
        stream = RequestStream(f"req-{next(_ids)}", asyncio.get_running_loop())
        engine.submit(
            Request(stream.request_id, tuple(engine.tokenizer.encode(prompt)), params), stream
        )
        first, text = None, ""
        while True:
            event = await stream.get()
            assert event is not None and event.error is None, event
            if first is None:
                first = time.monotonic()
            text += event.text
            if event.finish_reason:
                return first, text

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        solo = [(await generate(engine, p, max_tokens=6))[0] for p in PROMPTS[:3]]
        tasks, sent = [], []
        for prompt in PROMPTS[:3]:
            sent.append(time.monotonic())
            tasks.append(asyncio.create_task(first_token_time(engine, prompt)))
            await asyncio.sleep(0.15)
        results = await asyncio.gather(*tasks)
        assert min(first for first, _ in results) >= sent[-1]
        assert [text for _, text in results] == solo

    asyncio.run(main())
