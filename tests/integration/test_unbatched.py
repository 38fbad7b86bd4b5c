"""A model that cannot batch serves its requests one at a time (issue 41, defect 1),
with real tiny models whose mlx-lm code raises when several requests share a step,
each alone working: gpt_bigcode ("Only length-1 arrays can be converted to Python
scalars"), llama4 ("ChunkedKVCache does not yet support batching with history") and
gemma2 (a batch mask that does not broadcast against its grouped scores).
The load-time probe finds it; four requests at once all complete with their solo
answers, and /health's ``batching`` says why. So does a model whose batch runs but
gives other tokens than each request alone (defect 2: mlx-lm's afm7 and
longcat_flash_ngram, whose own ``batch_generate`` differs from its solo output).
On the plain strategy (a GPU's) with a prefix cache, llama4's requests prefill on the
side and, their cache unable to join the batch, decode as the solo sequence."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from omlx.engine import assembly, profile_stress
from omlx.engine.engine_status import engine_status
from tests.fixtures.breadth_models import build_breadth_model
from tests.fixtures.tiny_models import build_tiny_model
from tests.integration.test_memory_admission import generate

ERRORS = {
    "gpt_bigcode": "Only length-1 arrays",
    "llama4": "ChunkedKVCache'> does not yet support batching",
    # mlx-lm's gemma2 masks (B, 1, L, L) against scores (B, kv, rep, L, L).
    "gguf-gemma2": "cannot be broadcast",
}
# Batched output that differs from solo (mlx-lm's own batch_generate differs too).
WRONG_BATCH = ["afm7", "longcat_flash_ngram"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unbatched")
    for arch in ERRORS:
        build_tiny_model(root / arch, arch)
    for model_type in WRONG_BATCH:
        build_breadth_model(root / model_type, model_type)
    build_tiny_model(root / "llama", "llama")
    return root


async def _four_at_once_as_alone(engine) -> None:
    prompts = [[5 + (i * 7 + j) % 300 for j in range(40 + 10 * i)] for i in range(4)]
    solo = [await generate(engine, f"solo-{i}", p, 12) for i, p in enumerate(prompts)]
    for round_ in range(2):
        together = await asyncio.gather(
            *(generate(engine, f"r{round_}-{i}", p, 12) for i, p in enumerate(prompts))
        )
        assert together == solo
    assert engine.finish_counts["error"] == 0


@pytest.mark.parametrize("arch", list(ERRORS))
def test_a_model_that_cannot_batch_is_found_at_load_and_serves_one_at_a_time(
    make_pool, models_dir: Path, arch: str
) -> None:
    pool = make_pool(models_dir, max_concurrent_requests=8)

    async def main() -> None:
        engine = await pool.get_engine(arch)
        batching = engine_status(engine)["batching"]
        assert batching["one_at_a_time"] and "failed at load" in batching["reason"]
        assert ERRORS[arch] in batching["reason"]
        await _four_at_once_as_alone(engine)

    asyncio.run(main())


def test_llama4_on_the_plain_strategy_with_a_prefix_cache_decodes_as_the_solo_sequence(
    make_pool, models_dir: Path
) -> None:
    # The plain strategy (what a GPU runs) prefills a request on the side where the prefix
    # cache snapshots its layers; llama4's ChunkedKVCache cannot join the batch there, so
    # it decodes on its own (every request failed with "cannot be batched" before). Its
    # tokens are those the CPU's fast paths give without a cache.
    cache = {"enabled": True, "block_size": 16, "hot_cache_max_size": "256MB"}
    prompts = [[5 + (i * 7 + j) % 300 for j in range(40 + 10 * i)] for i in range(3)]

    async def answers(pool) -> list:
        engine = await pool.get_engine("llama4")
        return [await generate(engine, f"r{i}", p, 12) for i, p in enumerate(prompts)]

    fast = asyncio.run(answers(make_pool(models_dir, max_concurrent_requests=8)))
    plain = make_pool(
        models_dir, cache=cache, max_concurrent_requests=8, execution_strategy="plain"
    )
    assert asyncio.run(answers(plain)) == fast
    assert plain.load_facts("llama4")["execution_strategy"]["solo_prefill"] is False

    async def main() -> None:
        await _four_at_once_as_alone(await plain.get_engine("llama4"))

    asyncio.run(main())


@pytest.mark.parametrize("model_type", WRONG_BATCH)
def test_a_model_whose_batch_differs_from_solo_is_found_at_load_and_served_one_at_a_time(
    make_pool, models_dir: Path, model_type: str
) -> None:
    pool = make_pool(models_dir, max_concurrent_requests=8)

    async def main() -> None:
        engine = await pool.get_engine(model_type)
        batching = engine_status(engine)["batching"]
        assert batching["one_at_a_time"]
        assert batching["reason"].startswith("batched output differs from solo (row ")
        await _four_at_once_as_alone(engine)

    asyncio.run(main())


def test_a_model_whose_batch_gives_its_solo_output_stays_batched(
    make_pool, models_dir: Path
) -> None:
    pool = make_pool(models_dir, max_concurrent_requests=8)

    async def main() -> None:
        engine = await pool.get_engine("llama")
        assert engine_status(engine)["batching"] == {"one_at_a_time": False, "reason": None}
        await _four_at_once_as_alone(engine)
        assert engine_status(engine)["batching"]["one_at_a_time"] is False

    asyncio.run(main())


def test_a_batch_that_fails_after_load_is_served_again_one_at_a_time(
    make_pool, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For a model the load-time checks miss (none is known here, so the probes and
    the profile's batched pass are switched off: a stand-in for a failure only a
    later step meets), the first failed step of several requests requeues them and
    none sees the error."""
    monkeypatch.setattr(assembly, "batch_probe", lambda model, vocab_size: None)
    monkeypatch.setattr(assembly, "output_probe", lambda *args: None)
    # The profile runs its batched prefill at two rows or more however slow the model.
    monkeypatch.setattr(profile_stress.Stress, "batched_prefill", lambda self, rows: None)
    # Fresh: a verdict stored by the tests above would skip the (switched off) probes.
    pool = make_pool(models_dir, max_concurrent_requests=8, fresh_profile=True)

    async def main() -> None:
        engine = await pool.get_engine("gpt_bigcode")
        assert engine_status(engine)["batching"] == {"one_at_a_time": False, "reason": None}
        await _four_at_once_as_alone(engine)
        batching = engine_status(engine)["batching"]
        assert batching["one_at_a_time"] and "a batch of 4 requests failed" in batching["reason"]

    asyncio.run(main())


def test_the_verdict_is_kept_for_the_next_load_until_a_model_file_changes(
    make_pool, models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart reuses the load-time verdict (batching_verdict.py) without running
    the probes' forwards again; a changed weight file probes again."""
    models = tmp_path / "models"
    shutil.copytree(models_dir / "afm7", models / "afm7")
    probes: list[str] = []
    real_probe = assembly.output_probe

    def counted_probe(*args: object) -> str | None:
        probes.append("output")
        return real_probe(*args)

    monkeypatch.setattr(assembly, "output_probe", counted_probe)

    def reason_at_load() -> str:
        pool = make_pool(models, max_concurrent_requests=8, fresh_profile=True)
        engine = asyncio.run(pool.get_engine("afm7"))
        return engine_status(engine)["batching"]["reason"]

    first = reason_at_load()
    assert first.startswith("batched output differs from solo") and probes == ["output"]
    assert reason_at_load() == first and probes == ["output"]  # reused: no probe
    weights = next(models.glob("afm7/*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert reason_at_load() == first and probes == ["output", "output"]
