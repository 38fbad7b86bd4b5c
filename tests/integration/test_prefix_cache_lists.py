"""The prefix cache of models whose caches are CacheLists or chunked (issue 41,
defect 3), on real tiny models served by the engine: llama4 (ChunkedKVCache
layers, served one request at a time), falcon_h1 (mamba state + attention in each
layer's CacheList), baichuan_m1 (conv state + sliding window or global KV),
deepseek_v32 (MLA latents + the sparse indexer's keys: sliceable), longcat_flash (two
MLA attentions per layer: sliceable) and longcat_flash_ngram (the same after an
ArraysCache of the last tokens, for its n-gram embeddings).

A long prompt's greedy answer equals mlx-lm's own, whether its prefix was computed
now, restored from the RAM tier (also after an unload and reload) or, after a
restart, from the SSD tier; /admin/api/cache/clear clears the model's blocks.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer

from omlx.cache import kv_codec
from omlx.engine.model_engine import ModelEngine
from omlx.engine.stream import RequestStream
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_models import build_tiny_model
from tests.integration.test_prefix_cache import settle

BLOCK = 16
CACHE = {"enabled": True, "block_size": BLOCK, "hot_cache_max_size": "256MB"}
MAX_TOKENS = 12
# Every pool's and the server's prefill chunk: each prompt takes a few.
STEP = 32
# The layout kinds of each model's layers: every kind a CacheList or chunked model
# brings. llama4's 32-token chunks, baichuan_m1's 32-token windows and deepseek_v32's
# top-16 indexer all come into play.
MODELS = {
    "llama4": ("chunked:32", "kv"),
    "falcon_h1": ("list[arrays:2,kv]",),
    "baichuan_m1": ("list[arrays:2,rotating:32:0]", "list[arrays:2,kv]"),
    "deepseek_v32": ("list[kv,kv]",),
    "longcat_flash": ("list[kv,kv]",),
    "longcat_flash_ngram": ("arrays:1", "list[kv,kv]"),
}
TEXT = (
    "The memory of the machine is shared between the processor and the graphics unit. "
    "When one request fills it, every other program on the machine feels it. "
) * 2

_ids = itertools.count()


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache-list-models")
    for seed, arch in enumerate(MODELS):
        build_tiny_model(root / arch, arch, seed=seed)
    return root


def _greedy_tokens(model_dir: Path, prompt: list[int]) -> list[int]:
    """mlx-lm's own greedy answer to ``prompt`` (up to its EOS)."""
    model, tokenizer = load(str(model_dir))
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        if int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    return tokens


@pytest.fixture(scope="module")
def expected(models_dir: Path) -> dict[str, tuple[list[int], tuple[str, int]]]:
    """Each model's prompt and mlx-lm's greedy answer to it: its text as served
    (special tokens left out) and its number of tokens."""
    out = {}
    for arch in MODELS:
        tokenizer = load_tokenizer(models_dir / arch)
        prompt = list(tokenizer.encode(TEXT))
        tokens = _greedy_tokens(models_dir / arch, prompt)
        out[arch] = (prompt, (tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)))
    return out


async def generate(engine: ModelEngine, ids: list[int]) -> tuple[tuple[str, int], int]:
    """((text, tokens), prompt tokens served from the cache) of one greedy request."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    stream = RequestStream(f"req-{next(_ids)}", asyncio.get_running_loop())
    engine.submit(Request(stream.request_id, tuple(ids), params), stream)
    text, cached = "", 0
    while True:
        event = await stream.get()
        assert event is not None and event.error is None, event
        text += event.text
        cached = max(cached, event.num_cached_tokens)
        if event.finish_reason:
            return (text, event.num_output_tokens), cached


@pytest.mark.parametrize("arch", list(MODELS))
def test_a_hit_from_ram_after_a_reload_and_from_ssd_after_a_restart_answers_as_mlx_lm(
    make_pool, models_dir: Path, expected: dict, arch: str
) -> None:
    prompt, answer = expected[arch]
    assert len(prompt) > 6 * BLOCK

    async def served(pool, reload: bool) -> tuple[tuple[str, int], int, dict]:
        if reload:
            await pool.unload(arch)
        engine = await pool.get_engine(arch)
        assert engine.prefix_cache is not None and set(engine.prefix_cache.layout) == set(
            MODELS[arch]
        )
        text, cached = await generate(engine, prompt)
        await settle(engine)
        return text, cached, engine.prefix_cache.stats()

    async def first_run() -> None:
        pool = make_pool(models_dir, cache=CACHE, prefill_step_size=STEP)
        assert (await served(pool, reload=False))[:2] == (answer, 0)
        # Every prompt token but the last (whose logits start the answer).
        assert (await served(pool, reload=False))[:2] == (answer, len(prompt) - 1)
        assert (await served(pool, reload=True))[:2] == (answer, len(prompt) - 1)
        await pool.close()  # write-back: the RAM blocks go to the SSD

    asyncio.run(first_run())

    async def restart() -> None:
        pool = make_pool(models_dir, cache=CACHE, prefill_step_size=STEP)
        text, cached, stats = await served(pool, reload=False)
        assert (text, cached) == (answer, len(prompt) - 1)
        assert stats["ssd"]["hits"] > 0
        await pool.close()

    asyncio.run(restart())


def test_usage_reports_the_hit_and_the_admin_clear_drops_it(
    models_dir: Path, expected: dict, tmp_path: Path, profiles_dir: Path
) -> None:
    # The pools' chunk size: the server reuses the auto-profiles (and batching verdicts)
    # the tests above measured for these models, instead of measuring all six again.
    scheduler = {"prefill_step_size": STEP}
    with (
        live_server(
            tmp_path, models_dir, profiles=profiles_dir, cache=CACHE, scheduler=scheduler
        ) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as http,
    ):

        def cached_tokens(arch: str) -> int:
            prompt, (answer, num_tokens) = expected[arch]
            ask = {"model": arch, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            reply = http.post("/v1/completions", json=ask)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == answer
            assert reply.json()["usage"]["completion_tokens"] == num_tokens
            return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        for arch in MODELS:
            prompt, _ = expected[arch]
            assert cached_tokens(arch) == 0
            assert cached_tokens(arch) == len(prompt) - 1
            cleared = http.post("/admin/api/cache/clear", json={"model": arch, "tier": "both"})
            assert cleared.status_code == 200, cleared.text
            assert cached_tokens(arch) == 0


@pytest.mark.parametrize("arch", ["falcon_h1", "baichuan_m1", "deepseek_v32"])
def test_hits_of_requests_that_arrive_together_answer_as_each_alone(
    make_pool, models_dir: Path, expected: dict, arch: str
) -> None:
    """Four prompts sharing a cached opening, at once: each restores it and joins the
    batch (a CacheList merges sub-cache by sub-cache) with its answer alone."""
    shared, _ = expected[arch]
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=STEP)

    async def main() -> None:
        engine = await pool.get_engine(arch)
        prompts = [shared + list(engine.tokenizer.encode(f" Question {i}?")) for i in range(4)]
        alone = []
        for prompt in prompts:  # each computed from nothing
            await settle(engine)
            engine.prefix_cache.clear("both")
            answer, cached = await generate(engine, prompt)
            assert cached == 0
            alone.append(answer)
        await settle(engine)
        engine.prefix_cache.clear("both")
        await generate(engine, shared)
        await settle(engine)
        together = await asyncio.gather(*(generate(engine, p) for p in prompts))
        assert [answer for answer, _ in together] == alone
        assert all(cached >= len(shared) // BLOCK * BLOCK for _, cached in together)

    asyncio.run(main())


@pytest.mark.parametrize("arch", ["deepseek_v32", "longcat_flash"])
def test_answers_that_leave_the_batch_are_cached_up_to_their_last_fed_token(
    make_pool, models_dir: Path, expected: dict, arch: str
) -> None:
    """A sliceable CacheList model's requests leave the batch holding their prompt and
    all but their last output token: a next turn that repeats an answer hits it (a
    hit past what the cache held would serve another state: other tokens)."""
    shared, _ = expected[arch]
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=STEP)

    async def main() -> None:
        engine = await pool.get_engine(arch)
        prompts = [shared + list(engine.tokenizer.encode(f" Question {i}?")) for i in range(3)]
        await asyncio.gather(*(generate(engine, p) for p in prompts))
        await settle(engine)
        answer = _greedy_tokens(models_dir / arch, prompts[0])
        follow = prompts[0] + answer + list(engine.tokenizer.encode(" And then?"))
        warm, cached = await generate(engine, follow)
        assert cached >= len(prompts[0]) + len(answer) - 1
        await settle(engine)
        engine.prefix_cache.clear("both")
        assert await generate(engine, follow) == (warm, 0)

    asyncio.run(main())


def test_a_snapshot_that_fails_never_fails_the_request(
    make_pool, models_dir: Path, expected: dict, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """The cache is an optimisation: a boundary snapshot that raises (here: made to)
    during a prefill is logged, and the request answers as mlx-lm, uncached."""

    def broken(layers, since=0):
        raise ValueError("a snapshot that cannot be taken")

    monkeypatch.setattr(kv_codec, "snapshot", broken)
    prompt, answer = expected["llama4"]
    pool = make_pool(models_dir, cache=CACHE, prefill_step_size=STEP)

    async def main() -> None:
        engine = await pool.get_engine("llama4")
        for _ in range(2):
            assert await generate(engine, prompt) == (answer, 0)
            await settle(engine)

    asyncio.run(main())
    assert "prefix cache snapshot or store failed" in caplog.text
