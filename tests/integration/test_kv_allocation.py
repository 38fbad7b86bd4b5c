"""The KV the runner's caches really allocate, against what the memory guard counts.

mlx-lm's caches grow ``step`` (256) columns at a time: a sequence holds up to 255
columns past its tokens, and a batch pads every row to the longest first. On a Mac
one allocation past the GPU working set can panic the kernel, so the guard's count
(``Scheduler.kv_load.allocated`` priced by ``ModelDims.kv_bytes``: the KV capacity,
admission's KV still to come, the join copy) must cover what the caches hold at
every step: a request alone, rows joining a batch, full-precision, quantized and
sliding-window caches. The front door counts a lone prompt so against the capacity,
and the forward gate prices a prefill chunk as its cache grows. And a batch whose
padded price passes the hard limit makes short requests wait in the queue, none ended.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from omlx.engine.stream import RequestStream
from omlx.errors import PrefillMemoryExceededError
from omlx.memory.budget import Limits, MemoryReading, attention_transient_bytes
from omlx.memory.kv_profile import KVProfile
from omlx.memory.probe import PEAK_WINDOW_S
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.tiny_models import build_tiny_model
from tests.integration.test_memory_admission import MARGIN, MB, MLXProbe, generate

LONG, SHORT = 600, 8  # tokens: the long prompt's cache grows past 512, then 768 columns


@dataclass(frozen=True)
class Step:
    held: int  # bytes of every K/V array the runner's caches hold
    counted: int  # the guard's count: kv_bytes(kv_load.allocated)
    rows: int  # requests running
    step: int  # the growth step the scheduler counts with
    prefilling: bool  # a prompt still prefills (its KV is counted whole at admission)


def _kv_arrays(layer: Any) -> list[Any]:
    """A layer cache's K/V arrays (a quantized layer's triples, a cache list's parts);
    none for fixed states (SSM, convolution): the guard does not price those per token."""
    parts = getattr(layer, "caches", None)
    if parts is not None:
        return [a for part in parts for a in _kv_arrays(part)]
    arrays = []
    for kv in (getattr(layer, "keys", None), getattr(layer, "values", None)):
        arrays.extend(kv if isinstance(kv, tuple | list) else [kv] if kv is not None else [])
    return arrays


def held_kv_bytes(runner: Any) -> int:
    """The bytes of the K/V arrays every cache of the runner holds: the decode batch,
    the prefill batch, the sequences running on their own (alone, on the side)."""
    layers = list(runner._decode._cache)
    if runner._prefill._batch is not None:
        layers += runner._prefill._batch.prompt_cache
    for running in runner._sequences:
        layers += running.sequence.cache
    return sum(a.nbytes for layer in layers for a in _kv_arrays(layer))


def watch(engine: Any) -> list[Step]:
    """After every executed step (on the MLX thread): the caches' bytes beside the
    guard's count of the running requests (those the step ran, none left over)."""
    runner, scheduler, dims = engine._runner, engine._scheduler, engine.guard.dims
    steps: list[Step] = []
    execute = runner.execute

    def spy(plan: Any) -> Any:
        out = execute(plan)
        load = scheduler.kv_load
        counted = dims.kv_bytes(load.allocated)
        prefilling = bool(runner.prefill_plan())
        steps.append(Step(held_kv_bytes(runner), counted, load.rows, load.step, prefilling))
        return out

    runner.execute = spy
    return steps


async def long_then_shorts(engine: Any, steps: list[Step], long_tokens: int = 200) -> list:
    """A long prompt decoding alone, then three short chats joining it."""
    long = asyncio.ensure_future(
        generate(engine, "long", [5 + j % 400 for j in range(LONG)], max_tokens=long_tokens)
    )
    while len(steps) < 8 and not long.done():
        await asyncio.sleep(0.005)
    shorts = [generate(engine, f"s{i}", [7 + i + j for j in range(SHORT)], 48) for i in range(3)]
    return await asyncio.gather(long, *shorts)


def check(steps: list[Step], dims: Any, *, upper: bool = True) -> None:
    """Every step: the guard counts at least what the caches hold. ``upper``: once
    nothing prefills, at most one growth step a row more (rows x 256 columns)."""
    assert any(s.rows == 1 and not s.prefilling for s in steps), "never decoded alone"
    assert any(s.rows == 4 for s in steps), "the shorts never joined the long row"
    assert all(s.step == 256 for s in steps), {s.step for s in steps}
    under = [s for s in steps if s.held > s.counted]
    assert not under, f"{len(under)} steps hold more KV than the guard counts, first {under[0]}"
    if upper:
        over = [
            s
            for s in steps
            if not s.prefilling and s.counted > s.held + dims.kv_bytes(s.rows * s.step)
        ]
        assert not over, f"the guard counts over a step a row more, first {over[0]}"


def run(pool: Any, name: str) -> tuple[list[Step], Any]:
    async def main() -> tuple[list[Step], Any]:
        engine = await pool.get_engine(name)
        steps = watch(engine)
        results = await long_then_shorts(engine, steps)
        assert all(reason in ("stop", "length") for reason, _ in results), results
        return steps, engine.guard.dims

    return asyncio.run(main())


def test_the_guard_counts_what_the_caches_allocate_alone_and_batched(make_pool) -> None:
    """A 600-token prompt alone (its cache grown to 768 columns, 512 + 256), then
    three 8-token chats joining it (a batch padded to its longest row, each row
    growing 256 columns at a time): at every step the guard's count is at least the
    caches' K/V bytes and, once nothing prefills, at most rows x 256 columns more."""
    pool = make_pool(max_concurrent_requests=8, prefill_step_size=512)
    steps, dims = run(pool, "tiny-llama")
    check(steps, dims)


def test_a_quantized_cache_is_counted_as_it_grows(make_pool, tmp_path: Path) -> None:
    """The same with the model's KV quantized to 8 bits (omlx's batch form grows by
    mlx-lm's ``QuantizedKVCache.step``), on a tiny llama with 64-wide heads (they
    quantize in groups of 32; tiny-llama's 16-wide ones do not)."""
    build_tiny_model(tmp_path / "models" / "tiny-llama-64", num_attention_heads=2, hidden_size=128)
    pool = make_pool(tmp_path / "models", max_concurrent_requests=8, prefill_step_size=512)
    pool.model_settings.put("tiny-llama-64", {"kv_bits": 8})
    steps, dims = run(pool, "tiny-llama-64")
    assert dims.head_dim == 64
    check(steps, dims)


def test_sliding_window_caches_are_counted_at_most_as_if_they_grew(
    make_pool, tmp_path: Path
) -> None:
    """gemma3: half its layers keep a 32-token rotating window (allocated up to the
    window, or window - 1 + a chunk while prefilling). The guard prices them as if
    they grew (conservative): never under what the caches hold."""
    build_tiny_model(tmp_path / "models" / "tiny-gemma3", "gemma3_text", seed=3)
    pool = make_pool(tmp_path / "models", max_concurrent_requests=8, prefill_step_size=512)
    steps, dims = run(pool, "tiny-gemma3")
    check(steps, dims, upper=False)


def test_the_front_door_refuses_a_prompt_whose_cache_passes_the_capacity(make_pool) -> None:
    """With the KV capacity pinned at 700 tokens, a 600-token prompt fits by its tokens
    but not by its cache: alone it grows to 768 columns and more (the caches' bytes
    show it when the capacity is lifted), so the front door refuses it (HTTP 400,
    naming the columns) rather than run it past the capacity. A 444-token prompt,
    444 + 256 = 700 columns counted, is let in and its prefill's cache stays within them."""
    cap = LONG + 100
    pool = make_pool(memory={"max_kv_tokens": cap}, max_concurrent_requests=8)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        dims, steps = engine.guard.dims, watch(engine)
        with pytest.raises(PrefillMemoryExceededError, match="856 KV columns"):
            await generate(engine, "long", [5 + j % 400 for j in range(LONG)])
        fits = await generate(engine, "fits", [5 + j % 400 for j in range(cap - 256)])
        assert fits[0] in ("stop", "length"), fits
        # Its prefill within the 700 columns; then each decoded token is counted too.
        assert steps[0].held <= dims.kv_bytes(cap)
        assert all(s.held <= s.counted for s in steps), steps
        # Lifted, the refused prompt runs: its cache really holds more than the capacity.
        lifted = KVProfile(max_kv_tokens=10 * cap, source="explicit", baseline_bytes=0)
        engine.guard.set_profile(lifted)
        steps.clear()
        refused = await generate(engine, "long", [5 + j % 400 for j in range(LONG)])
        assert refused[0] in ("stop", "length"), refused
        assert max(s.held for s in steps) > dims.kv_bytes(cap)

    asyncio.run(main())


def test_the_forward_gate_prices_a_chunk_as_its_cache_allocates_it(make_pool) -> None:
    """A 300-token prompt prefills in one chunk on tiny-llama: its cache takes 512
    columns (256 at a time), not 300 (the caches' bytes show it). Under a hard limit
    with room for everything the gate prices but the chunk's 300 computed keys and
    the cache they are written into (its real bytes), the gate refuses the chunk: it
    prices the cache as it allocates it (``written_columns``), never the bare tokens
    (300 + 300 columns would fit that room)."""
    pool = make_pool(max_concurrent_requests=8, prefill_step_size=512)

    async def main() -> None:
        engine = await pool.get_engine("tiny-llama")
        guard, steps = engine.guard, watch(engine)
        result = await generate(engine, "p", [5 + j % 400 for j in range(300)], 1)
        assert result[0] in ("stop", "length"), result
        held = steps[0].held  # the cache after the chunk
        assert held >= guard.dims.kv_bytes(512) > guard.dims.kv_bytes(300 + 1)
        resident = 1 << 30
        reading = MemoryReading(resident, resident, resident, taken_at_s=0.0)
        attention = attention_transient_bytes(guard.dims, chunk_tokens=300, num_context_tokens=300)
        room = attention + guard.unmodeled_bytes + guard.dims.kv_bytes(300) + held - 1
        margin = guard.limits.transient_margin_bytes
        guard.limits = Limits(resident + margin + room, resident + margin + room, margin)
        assert not guard.gate(300, 0, reading, others=False)
        # And a chunk its cache holds within the room passes: the price is not blind.
        assert guard.gate(1, 0, reading, others=False)

    asyncio.run(main())


def test_short_requests_wait_while_their_padded_price_passes_the_hard_limit(make_pool) -> None:
    """A 2048-token conversation decodes on slow-llama; then the hard limit is set
    70 MB (plus the margin) above memory. Three 8-token chats arrive: unpadded, one
    would cost its few tokens plus a copy of the batch (~35 MB), but padded to the
    long row and grown it costs about 120 MB (a second row of 2048+256 columns still
    to come, and the join's copy of both). They wait in the queue for memory (not
    for the KV capacity: it is pinned high, so the one derived from the limit does
    not hold them first), none is ended, and all finish after the long one, memory
    never past the limit."""
    pool = make_pool(
        fresh_profile=True,
        memory={"max_kv_tokens": 65536},  # pinned high: the hard limit is what holds them
        max_concurrent_requests=8,
        prefill_step_size=512,
    )

    async def main() -> None:
        probe = pool.probe = MLXProbe()
        engine = await pool.get_engine("slow-llama")
        done: list[str] = []
        stream = RequestStream("long", asyncio.get_running_loop())
        params = SamplingParams(temperature=0.0, max_tokens=300)
        engine.submit(Request("long", tuple(5 + j % 400 for j in range(2048)), params), stream)
        event = await stream.get()  # its first token: it decodes now
        await asyncio.sleep(PEAK_WINDOW_S + 0.1)  # its prefill's peak is no longer recent
        hard = probe.reading(fresh=True).resident_bytes + MARGIN + 70 * MB
        pool.limits = Limits(hard, hard, MARGIN)
        engine.guard.publish(pool.limits)
        dims, load = engine.guard.dims, engine._scheduler.kv_load
        # Unpadded, a short row's price (the join's copy of the tokens) fits the room.
        assert dims.kv_bytes(load.tokens + SHORT) < 70 * MB
        probe.max_peak = 0

        async def short(i: int) -> tuple[str, str]:
            result = await generate(engine, f"s{i}", [7 + i + j for j in range(SHORT)], 16)
            done.append(f"s{i}")
            return result

        shorts = asyncio.gather(*(short(i) for i in range(3)))
        while not (event.finish_reason or event.error):
            event = await stream.get()
        done.append("long")
        results = await shorts
        assert event.finish_reason in ("stop", "length"), event
        assert all(reason in ("stop", "length") for reason, _ in results), results
        assert done[0] == "long", f"a short ran beside the long row: {done}"
        deferrals = engine.gate.deferrals
        assert deferrals["memory"] > 0 and deferrals["kv_capacity"] == 0, deferrals
        assert engine.num_gated == 0
        probe.reading(fresh=True)
        assert probe.max_peak <= hard

    asyncio.run(main())
