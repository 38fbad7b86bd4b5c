"""Every architecture the pinned mlx-lm instantiates, served exactly as mlx-lm serves it
(issue 41, "breadth as a test").

One tiny random model per model type (tests/fixtures/breadth_models.py) goes through
one engine pool, and for each: a request alone gives mlx-lm's own greedy tokens; four
at once give each its solo tokens and logprobs; a long prompt sent twice is a
prefix-cache hit the second time with mlx-lm's tokens; the memory guard's KV per token
is read from the model's cache. A type mlx-lm adds fails ``test_every_type_is_covered``
until it is built here or listed in ``EXCLUDED`` with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import psutil
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from omlx.engine.kv_measure import cache_bytes_per_token
from omlx.engine.model_engine import ModelEngine
from omlx.engine.pool import EnginePool
from omlx.engine.stream import RequestStream
from omlx.engine.token_text import TokenText
from omlx.engine.worker import MLXWorker
from omlx.memory.footprint import ProcessFootprint
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.breadth_models import EXCLUDED, OVERRIDES, build_breadth_model, model_types
from tests.integration.conftest import pool_settings

TYPES = model_types()
COVERED = [t for t in TYPES if t not in EXCLUDED]

# Types whose cache the prefix cache cannot store yet (the long prompt runs cold).
NO_PREFIX_CACHE: dict[str, str] = {
    "deepseek_v41": "its own LayerCache (compressed attention): no codec for it",
}  # fmt: skip

# Types whose cache kv_measure.py finds no K/V growing per token in: the guard keeps the
# config's figure (the measurement must say 0).
CONFIG_KV_FIGURE: dict[str, str] = {
    **dict.fromkeys(["mamba", "mamba2", "rwkv7"], "recurrent states only: no KV per token"),
    # Its LayerCache measured from a prefill of 32 tokens to one of 288 (kv_measure.py).
    "deepseek_v41": "its tiny model's layers keep a 16-token window only (no compressed "
    "layers): a fixed state a sequence, no KV per token",
}

# Types whose mlx-lm output depends on how the prompt is chunked, so "mlx-lm's tokens"
# is not one answer: the engine's runs are checked against each other instead.
CHUNKING_DEPENDENT: dict[str, str] = {
    "plamo3": (
        "mlx-lm's plamo3 masks a window one wider than its rotating cache: its own "
        "generate gives other tokens at prefill_step_size 8 than 2048 (omlx gives a "
        "cache-free forward's)"
    ),
}

BLOCK = 16
CACHE = {"enabled": True, "block_size": BLOCK, "hot_cache_max_size": "256MB"}
NUM_TOKENS = 8
_ids = itertools.count()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Every covered type's tiny model, built once (seconds for all of them), and
    why each that could not be built failed (its own test fails with it)."""
    root = tmp_path_factory.mktemp("breadth")
    started = time.monotonic()
    failed = {}
    for model_type in COVERED:
        try:
            build_breadth_model(root / model_type, model_type)
        except (Exception, SystemExit) as exc:  # args beyond SMALL + OVERRIDES; an exit
            failed[model_type] = f"{type(exc).__name__}: {exc}"
    print(f"built {len(COVERED) - len(failed)} tiny models in {time.monotonic() - started:.1f}s")
    return root, failed


@pytest.fixture(scope="module")
def breadth_dir(built: tuple[Path, dict[str, str]]) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def pool(breadth_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    """One pool for every type (each test unloads its model after)."""
    worker = MLXWorker()
    worker.start()
    base = tmp_path_factory.mktemp("breadth-base")
    # Four requests at a time and 64-token chunks: the load's auto-profile stresses
    # no more than that (it is most of each load), and long prompts are chunked. No
    # burst window: a request alone starts at once, and the four that run together
    # arrive as one (``_Client.generate_together``), taken in the same step.
    # A ceiling 2 GiB above what this process holds now (room for any tiny model): the
    # auto-profile's safety canary is 2% of it, ~70-100 MiB, where this machine's RAM
    # made it 256 MiB, whose fill cost ~0.13 s of CPU a load (test_auto_profile.py
    # checks the canary itself).
    held = ProcessFootprint.for_this_platform().bytes_of(psutil.Process())  # as the guard reads
    memory = {"max_process_memory": held + 2 * 1024**3}
    settings = pool_settings(
        base,
        breadth_dir,
        CACHE,
        memory,
        max_concurrent_requests=4,
        prefill_step_size=64,
        burst_window_ms=0,
    )
    engines = EnginePool(settings, worker)
    yield engines
    asyncio.run(engines.close())
    worker.stop()


def test_every_type_is_covered() -> None:
    """A type of the pinned mlx-lm is built here or listed with its reason."""
    stale = sorted((set(EXCLUDED) | set(OVERRIDES)) - set(TYPES))
    assert not stale, f"EXCLUDED or OVERRIDES name types mlx-lm does not have: {stale}"
    listed = set(NO_PREFIX_CACHE) | set(CONFIG_KV_FIGURE) | set(CHUNKING_DEPENDENT)
    assert listed <= set(COVERED), sorted(listed - set(COVERED))
    print(f"breadth: {len(COVERED)} of {len(TYPES)} mlx-lm model types covered")
    for what, listed in [
        ("not covered", EXCLUDED),
        ("no prefix cache", NO_PREFIX_CACHE),
        ("guard keeps the config's KV figure", CONFIG_KV_FIGURE),
        ("checked against itself, not mlx-lm", CHUNKING_DEPENDENT),
    ]:
        for model_type, reason in sorted(listed.items()):
            print(f"  {what}: {model_type}: {reason}")


def _prompt(seed: int, length: int) -> list[int]:
    return [3 + (seed * 37 + j * 11) % 500 for j in range(length)]


def _reference(model, prompt: list[int], num_tokens: int) -> list[int]:
    """mlx-lm's own greedy tokens."""
    steps = generate_step(mx.array(prompt), model, max_tokens=num_tokens)
    return [int(token) for token, _ in steps]


class _Client:
    """Greedy requests to one engine; each answer as (token ids, logprobs)."""

    def __init__(self, engine: ModelEngine):
        self.engine = engine
        pieces = TokenText(engine.tokenizer)
        vocab = engine.loaded.vocab_size
        self._id_of = {pieces.piece(i)[1]: i for i in range(vocab)}

    async def generate(self, prompt: list[int]) -> tuple[list[int], list[float], int]:
        """(tokens, their logprobs, prompt tokens served from the prefix cache)."""
        [answer] = await self.generate_together([prompt])
        return answer

    async def generate_together(
        self, prompts: list[list[int]]
    ) -> list[tuple[list[int], list[float], int]]:
        """Each prompt's answer, the prompts submitted as one arrival (the MLX thread
        takes them in the same step)."""
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=0)
        loop = asyncio.get_running_loop()
        pairs = []
        for prompt in prompts:
            stream = RequestStream(f"breadth-{next(_ids)}", loop)
            pairs.append((Request(stream.request_id, tuple(prompt), params), stream))
        self.engine.submit_together(pairs)
        streams = [stream for _, stream in pairs]
        return await asyncio.gather(*(self._answer(stream) for stream in streams))

    async def _answer(self, stream: RequestStream) -> tuple[list[int], list[float], int]:
        tokens, logprobs, cached = [], [], 0
        while True:
            event = await stream.get()
            assert event is not None and event.error is None, event
            cached = max(cached, event.num_cached_tokens)
            for entry in event.logprobs:
                tokens.append(self._id_of[entry.bytes])
                logprobs.append(entry.logprob)
            if event.finish_reason:
                return tokens, logprobs, cached

    async def settle(self) -> None:
        """Let the worker run the stores it defers to the step after a request."""
        for _ in range(100):
            if not self.engine.has_work:
                return
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("model_type", COVERED)
def test_served_as_mlx_lm_serves_it(
    pool: EnginePool, built: tuple[Path, dict[str, str]], model_type: str
) -> None:
    breadth_dir, failed = built
    if model_type in failed:
        pytest.fail(
            f"no tiny {model_type} (give it OVERRIDES in tests/fixtures/breadth_models.py, "
            f"or list it in EXCLUDED with the reason): {failed[model_type]}"
        )
    model, _ = load(str(breadth_dir / model_type))
    prompts = [_prompt(i, 20 + 5 * i) for i in range(4)]
    long_prompt = _prompt(9, 6 * BLOCK + 5)

    async def main() -> None:
        engine = await pool.get_engine(model_type)
        client = _Client(engine)
        try:
            # (a) alone == mlx-lm's greedy generate
            solo = [await client.generate(p) for p in prompts]
            exact = model_type not in CHUNKING_DEPENDENT
            for prompt, (tokens, _, _) in zip(prompts, solo, strict=True):
                if exact:
                    assert tokens == _reference(model, prompt, NUM_TOKENS)
            # (b) four at once == each alone
            together = await client.generate_together(prompts)
            for (tokens, lps, _), (solo_tokens, solo_lps, _) in zip(together, solo, strict=True):
                assert tokens == solo_tokens
                assert lps == pytest.approx(solo_lps, abs=1e-4)
            # (c) a long prompt twice: the second a prefix-cache hit, both mlx-lm's
            cold, _, _ = await client.generate(long_prompt)
            await client.settle()
            warm, _, cached = await client.generate(long_prompt)
            assert warm == cold
            if exact:
                assert cold == _reference(model, long_prompt, NUM_TOKENS)
            if model_type in NO_PREFIX_CACHE:
                assert cached == 0
            else:
                assert cached > 0
            # (d) the guard's KV per token is the model's own
            measured = engine.guard.dims.measured_kv_bytes_per_token
            if model_type in CONFIG_KV_FIGURE:
                assert measured is None and cache_bytes_per_token(model) == 0
            else:
                assert measured == cache_bytes_per_token(model) > 0
        finally:
            await pool.unload(model_type)

    asyncio.run(main())
