"""Preemption (issue 28): when KV capacity runs short while requests decode, the
newest running request goes back to the head of the queue, its blocks to the
prefix cache, and resumes from its cache hit with the output it gets alone:
greedy, seeded sampling and grammar-constrained requests alike. Real tiny-llama
on the real engine path."""

from __future__ import annotations

import asyncio
import json
import threading

from omlx.engine.stream import RequestStream
from omlx.grammar.spec import GrammarSpec
from omlx.scheduler import Request, SamplingParams

PROMPT = 48
OUTPUT = 40
FLOOD = 4
# The columns a row's cache may hold beyond its tokens through a step (its token and
# mlx-lm's 256-column growth: memory/dims.allocated_columns).
GROWTH = 256
# Room for every prompt at admission, not for their outputs: decoding runs short.
CAPACITY = FLOOD * (PROMPT + GROWTH) + OUTPUT


def prompts() -> list[tuple[int, ...]]:
    return [tuple(5 + (k * 11 + 7 * j) % 300 for j in range(PROMPT)) for k in range(FLOOD)]


async def generate(engine, rid: str, prompt, params: SamplingParams, grammar=None):
    stream = RequestStream(rid, asyncio.get_running_loop())
    engine.submit(Request(rid, tuple(prompt), params, grammar=grammar), stream)
    text, tokens = "", 0
    while True:
        event = await stream.get()
        assert event.error is None, event.error
        text, tokens = text + event.text, event.num_output_tokens
        if event.finish_reason:
            return event.finish_reason, text, tokens


async def flood(pool, engine, make) -> list:
    """Submit every request while the MLX thread is held: one step admits them all."""
    hold = threading.Event()
    pool.worker.post(hold.wait)
    tasks = [asyncio.create_task(make(k, p)) for k, p in enumerate(prompts())]
    await asyncio.sleep(0.05)
    hold.set()
    return await asyncio.gather(*tasks)


def _pool(make_pool):
    return make_pool(
        cache={"enabled": True, "block_size": 16},
        memory={"max_kv_tokens": CAPACITY},
        max_concurrent_requests=FLOOD,
    )


def _check_flood(pool, make, num_draft: int = 0) -> None:
    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        alone = [await make(engine, f"alone-{k}", p) for k, p in enumerate(prompts())]
        hits_before = engine.prefix_cache.stats()["hits"]
        engine.num_draft = num_draft  # the flood alone decodes speculatively (or not)
        together = await flood(pool, engine, lambda k, p: make(engine, f"flood-{k}", p))
        assert together == alone
        assert all(tokens == OUTPUT for _, _, tokens in together)
        assert engine.guard_counters()["preempted"]["kv_capacity"] >= 1 and engine.num_gated == 0
        # Resumed from the blocks they stored when preempted.
        assert engine.prefix_cache.stats()["hits"] > hits_before
        assert engine.num_in_flight == 0

    asyncio.run(main())


def test_greedy_requests_preempted_for_kv_capacity_resume_with_the_same_output(
    make_pool,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT)
    _check_flood(_pool(make_pool), lambda e, rid, p: generate(e, rid, p, params))


def test_seeded_sampling_resumes_with_the_same_output(make_pool) -> None:
    def make(engine, rid: str, prompt):
        seed = prompts().index(tuple(prompt))
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=OUTPUT)
        return generate(engine, rid, prompt, params)

    _check_flood(_pool(make_pool), make)


def test_seeded_sampling_preempted_while_speculating_resumes_with_the_same_output(
    make_pool,
) -> None:
    """Drafted positions draw with the keys plain steps use, so a seeded request
    preempted mid-speculation resumes with the output it gets alone, unspeculated."""

    def make(engine, rid: str, prompt):
        seed = prompts().index(tuple(prompt))
        params = SamplingParams(temperature=0.6, top_k=3, seed=seed, max_tokens=OUTPUT)
        return generate(engine, rid, prompt, params)

    pool = _pool(make_pool)
    _check_flood(pool, make, num_draft=4)
    (engine,) = pool.loaded()
    assert engine.speculative_stats()["accepted"] > 0


def test_a_grammar_request_resumes_where_its_grammar_was(make_pool) -> None:
    """The resumed grammar has accepted the output so far: the output is the one
    the request gets alone, and it parses."""
    pool = _pool(make_pool)
    spec = GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
            "required": ["items"],
        },
        strict=False,
        param="response_format",
    )
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT)

    async def make(engine, rid: str, prompt):
        compiler = await asyncio.to_thread(engine.grammar_compiler)
        from omlx.grammar.processor import BoundGrammar

        grammar = BoundGrammar(await asyncio.to_thread(compiler.compile, spec), compiler)
        return await generate(engine, rid, prompt, params, grammar)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        alone = [await make(engine, f"alone-{k}", p) for k, p in enumerate(prompts())]
        together = await flood(pool, engine, lambda k, p: make(engine, f"flood-{k}", p))
        assert together == alone
        assert engine.guard_counters()["preempted"]["kv_capacity"] >= 1
        for reason, text, _ in together:
            if reason == "stop":
                assert isinstance(json.loads(text)["items"], list)

    asyncio.run(main())
