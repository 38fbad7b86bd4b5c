"""A hybrid's fixed per-sequence states, priced per row by the memory guard (issue 40),
with real tiny mlx-lm hybrids: gated-delta (qwen3_next), short-convolution (lfm2) and
SSM (falcon_h1) layers keep a state per sequence whatever its length, beside the KV
of their attention layers. The guard measures it from the model's own cache and
counts it for every row: admission, the KV capacity, the join copy."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache

from omlx.engine.kv_measure import cache_state_bytes, with_measured_kv
from omlx.memory.budget import Limits, MemoryReading
from omlx.memory.dims import guard_dims
from omlx.memory.probe import MemoryProbe
from omlx.mlx_types import prompt_cache
from omlx.scheduler import Request, SamplingParams
from omlx.scheduler.plan import KVLoad
from tests.fixtures.state_models import build_gated_delta
from tests.fixtures.tiny_models import ARCH_CONFIGS, build_tiny_model
from tests.integration.test_memory_admission import MARGIN, generate

F32 = 4  # the tiny models' weights (and so their caches) are float32
HYBRIDS = ("gdn", "lfm2", "falcon_h1")
STEP = 256  # mlx-lm's KV caches grow by this many columns at a time


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("state-price")
    build_gated_delta(root / "gdn")
    for arch in ("lfm2", "falcon_h1", "qwen3"):
        build_tiny_model(root / arch, arch)
    return root


def held_bytes(cache: list[Any]) -> tuple[int, int]:
    """(KV arrays' bytes, fixed states' bytes) a cache holds now, padding included."""
    kv = states = 0
    for layer in cache:
        for part in getattr(layer, "caches", [layer]):
            if isinstance(part, ArraysCache):
                states += sum(a.nbytes for a in part.cache if a is not None)
            else:
                kv += sum(a.nbytes for a in (part.keys, part.values) if a is not None)
    return kv, states


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_measured_state_is_what_a_sequence_s_cache_holds(models: Path, name: str) -> None:
    model, _ = load(str(models / name))
    cache = prompt_cache(model)
    ids = mx.arange(3, 3 + 40, dtype=mx.int32).reshape(1, -1)  # not the probe's length
    mx.eval(model(ids, cache=cache))
    states = held_bytes(list(cache))[1]
    assert states > 0
    assert cache_state_bytes(model) == states
    config = ARCH_CONFIGS.get(name, {})
    dims = with_measured_kv(guard_dims(config, kv_dtype_bytes=F32, model=name), model, name)
    assert dims.state_bytes_per_sequence == states


def test_an_attention_model_holds_no_state_and_its_dims_are_unchanged(models: Path) -> None:
    model, _ = load(str(models / "qwen3"))
    assert cache_state_bytes(model) == 0
    dims = guard_dims(ARCH_CONFIGS["qwen3"], kv_dtype_bytes=F32, model="qwen3")
    measured = with_measured_kv(dims, model, "qwen3")
    assert measured.state_bytes_per_sequence == 0
    assert measured.kv_bytes_per_token == dims.kv_bytes_per_token
    assert all(measured.kv_bytes(n) == dims.kv_bytes(n) for n in (0, 1, 4096))


def test_the_guard_counts_every_row_s_state_at_each_step_of_a_batch(make_pool, models) -> None:
    """Four rows of a gated-delta hybrid decode together: at each step the bytes the
    KV capacity check counts (the rows' tokens, padded, and each row's state in
    tokens) cover the batch's real cache: KV arrays and every row's states."""
    pool = make_pool(models, max_concurrent_requests=8, prefill_step_size=512)

    async def main() -> tuple[list[tuple[int, int, int]], Any]:
        engine = await pool.get_engine("gdn")
        gate, guard = engine.gate, engine.gate.guard
        seen: list[tuple[int, int, int]] = []  # (real bytes, rows, bytes counted)
        checked = gate.kv_over_capacity

        def spy(load: KVLoad) -> bool:
            decode = engine._runner._decode
            real = sum(held_bytes(decode._cache)) if decode.rows else 0
            tokens = guard.kv_tokens(load.allocated, load.rows)  # as the capacity counts
            seen.append((real, len(decode.rows), guard.dims.kv_bytes(tokens)))
            return checked(load)

        gate.kv_over_capacity = spy
        prompts = [[5 + i + j for j in range(24 + 8 * i)] for i in range(4)]
        results = await asyncio.gather(
            *(generate(engine, f"r{i}", p, max_tokens=24) for i, p in enumerate(prompts))
        )
        assert all(reason in ("stop", "length") for reason, _ in results), results
        return seen, guard.dims

    seen, dims = asyncio.run(main())
    assert dims.state_bytes_per_sequence > 0
    assert any(rows == 4 for _, rows, _ in seen), f"never decoded in one batch: {seen}"
    for real, rows, counted in seen:
        growth = dims.kv_bytes(rows * STEP)  # columns mlx-lm allocates ahead
        assert real <= counted + growth, (
            f"a {rows}-row batch holds {real} bytes of KV and states; the guard counts "
            f"{counted} (+ {growth} of cache growth)"
        )


class StillProbe(MemoryProbe):
    """Real readings until ``held`` is set; then that many bytes held, steady."""

    def __init__(self) -> None:
        super().__init__(max_age_s=0.0)
        self.held: int | None = None

    def reading(self, *, fresh: bool = False) -> MemoryReading:
        if self.held is None:
            return super().reading(fresh=fresh)
        return MemoryReading(self.held, self.held, self.held, taken_at_s=0.0)


def test_admission_defers_a_row_whose_state_does_not_fit(make_pool, models: Path) -> None:
    """One row runs; a short prompt asks to join. The ceiling that admits it is higher
    by its state (made by its first forward) and the copy of both rows' states as it
    joins the batch: under a ceiling one byte short it waits in the queue, where a
    guard blind to states would have admitted it."""
    pool = make_pool(
        models, fresh_profile=True, memory={"max_kv_tokens": 100_000}, max_concurrent_requests=8
    )
    probe = pool.probe = StillProbe()

    async def main() -> tuple[int, int, int, int]:
        engine = await pool.get_engine("gdn")
        gate, guard = engine.gate, engine.guard
        probe.held = 100_000_000
        request = Request("join", tuple(range(5, 21)), SamplingParams(max_tokens=4))

        def admits(hard: int) -> bool:
            guard.publish(Limits(hard, int(hard * 0.99), MARGIN))
            gate.start_admission((), KVLoad(rows=1, longest=16, tokens=16))
            return gate.can_admit(request, num_running=1)

        def lowest_ceiling() -> int:
            low, high = probe.held, 2 * probe.held
            while low < high:
                mid = (low + high) // 2
                low, high = (low, mid) if admits(mid) else (mid + 1, high)
            return low

        priced = lowest_ceiling()
        state = guard.dims.state_bytes_per_sequence
        guard.dims = dataclasses.replace(guard.dims, state_bytes_per_sequence=0)
        blind = lowest_ceiling()
        guard.dims = dataclasses.replace(guard.dims, state_bytes_per_sequence=state)
        before = gate.deferrals["memory"]
        deferred = not admits(priced - 1)
        return priced, blind, state, int(deferred and gate.deferrals["memory"] == before + 1)

    priced, blind, state, deferred = asyncio.run(main())
    assert state > 0
    # Its own state, and both rows' states copied as it joins.
    assert priced - blind == 3 * state
    assert deferred
