"""mllama's image states, as the memory guard prices them (issue 41).

An mllama request keeps its image states (a text-wide row per patch of every tile)
in its cross-attention cache for as long as it runs, and its rows share the decode
batch, each row's states zero-padded to the most. The guard counts them as it counts
a row's KV: in the KV capacity (the front door, admission, preemption) and in
admission's price, with the copy a join makes of every row's padded states. These
tests run tiny-mllama on the real path and hold the guard's numbers against the
states' real arrays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omlx.api.images import ImagePart, process
from omlx.engine.gate_inputs import request_held_state_bytes
from omlx.errors import PrefillMemoryExceededError
from omlx.memory.budget import Limits
from omlx.memory.dims import allocated_columns
from omlx.memory.kv_profile import KVProfile
from omlx.models.cross_attention import CrossAttentionStates
from omlx.scheduler import Request, SamplingParams
from omlx.scheduler.plan import KVLoad
from tests.fixtures.frozen_probe import FrozenProbe
from tests.fixtures.tiny_vlms import build_tiny_vlm
from tests.integration.test_image_encode_gate import _collect as collect
from tests.integration.test_image_encode_gate import _submit as submit

MAX_TOKENS = 4
MB = 1_000_000


@pytest.fixture(scope="module")
def mllama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mllama-states")
    build_tiny_vlm(root / "tiny-mllama", "mllama", seed=0)
    return root


def image_request(engine: Any, rid: str, seed: int) -> Request:
    """A prompt with one image of four tiles (its processor's most)."""
    vision = engine.loaded.vision
    pixels = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).resize((56, 56), Image.Resampling.NEAREST).save(png, "PNG")
    text = f"{vision.image_text} what is in it?"
    part = ImagePart(png.getvalue(), "image")
    ids, images = process(vision.processor, text, [part], vision.image_token_id, vision.prompt_ids)
    return Request(
        rid, tuple(ids), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), images=images
    )


def held_states_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every row's image states as its prefill gives them to the
    cross-attention cache (the arrays the row then holds while it runs)."""
    seen: list[int] = []
    hold = CrossAttentionStates.hold

    def spy(self: CrossAttentionStates, states: Any) -> None:
        seen.append(states.nbytes)
        hold(self, states)

    monkeypatch.setattr(CrossAttentionStates, "hold", spy)
    return seen


def rows_per_step(engine: Any) -> list[int]:
    """The requests running after every executed step (MLX thread)."""
    runner, scheduler, rows = engine._runner, engine._scheduler, []
    execute = runner.execute

    def spy(plan: Any) -> Any:
        out = execute(plan)
        rows.append(scheduler.num_running)
        return out

    runner.execute = spy
    return rows


def capacity(engine: Any, max_kv_tokens: int) -> None:
    engine.guard.set_profile(
        KVProfile(max_kv_tokens=max_kv_tokens, source="explicit", baseline_bytes=0)
    )


def kv_tokens(engine: Any, num_bytes: int) -> int:
    """``num_bytes`` in KV tokens of the model, rounded up."""
    return -(-num_bytes // engine.guard.dims.kv_bytes_per_token)


def test_the_front_door_counts_an_image_requests_states_against_the_kv_capacity(
    make_pool, mllama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's price of an mllama image request's states is what its prefill
    really holds (the array's nbytes), and the KV capacity counts them with its
    cache: a capacity one KV token short of the prompt's columns plus its states
    refuses it (400, saying the image states are in it); one token more serves it,
    with the same answer as under an ample capacity."""
    pool = make_pool(mllama_dir, memory={"max_kv_tokens": 65536})
    seen = held_states_seen(monkeypatch)

    async def main() -> None:
        engine = await pool.get_engine("tiny-mllama")
        request = image_request(engine, "ample", seed=1)
        ample = await collect(submit(engine, request))
        assert len(seen) == 1 and seen[0] > 0, seen
        price = request_held_state_bytes(engine.loaded.vision, request)
        assert price == seen[0], (price, seen)  # the formula is the real array

        columns = allocated_columns(request.num_prompt_tokens, engine._scheduler.kv_step)
        needed = columns + kv_tokens(engine, seen[0])
        assert kv_tokens(engine, seen[0]) > 1, "the states are under one KV token"
        capacity(engine, needed - 1)
        short = image_request(engine, "short", seed=1)
        with pytest.raises(PrefillMemoryExceededError, match="its image states included"):
            submit(engine, short)
        capacity(engine, needed)
        assert await collect(submit(engine, image_request(engine, "fits", seed=1))) == ample

    asyncio.run(main())


def test_a_second_image_request_waits_while_two_rows_states_pass_the_capacity(
    make_pool, mllama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a KV capacity that holds two rows' KV columns but not their image states
    too, two mllama image requests sent together run one after the other: the second
    waits in the queue (a KV-capacity deferral, nothing ended) until the first
    finishes, and each answers as it does alone. Their states pass the room the
    decoding row's growth could take (2 x its tokens), so only the states hold it."""
    pool = make_pool(mllama_dir, memory={"max_kv_tokens": 65536})
    seen = held_states_seen(monkeypatch)

    async def main() -> None:
        engine = await pool.get_engine("tiny-mllama")
        first, second = image_request(engine, "a", seed=2), image_request(engine, "b", seed=3)
        alone = [await collect(submit(engine, r)) for r in (first, second)]
        states = kv_tokens(engine, sum(seen))
        assert states > 2 * (MAX_TOKENS + 1), (states, seen)
        two = KVLoad(step=engine._scheduler.kv_step).with_row(first.num_prompt_tokens)
        two = two.with_row(second.num_prompt_tokens)
        one_row = allocated_columns(first.num_prompt_tokens, two.step) + kv_tokens(engine, seen[0])
        capacity(engine, two.allocated + states - 1)
        assert one_row <= two.allocated + states - 1  # each fits alone

        rows = rows_per_step(engine)
        streams = [submit(engine, r) for r in (first, second)]
        answers = await asyncio.gather(*(collect(s) for s in streams))
        assert answers == alone
        assert max(rows) == 1, f"the two rows ran together: {rows}"
        assert engine.gate.deferrals["kv_capacity"] > 0, engine.gate.deferrals
        assert engine.num_gated == 0

    asyncio.run(main())


def lowest_limit(guard: Any, gate: Any, held: int, load: KVLoad, request: Request, n: int) -> int:
    """The lowest hard limit (bisected to the byte, from what is ``held``) under which
    the gate admits ``request`` (``n`` choices) beside ``load``: its admission price."""
    margin = guard.limits.transient_margin_bytes

    def admits(hard: int) -> bool:
        guard.publish(Limits(hard, hard, margin))
        gate.start_admission((), load)
        return bool(gate.can_admit(request, n))

    low, high = held, held + 10_000 * MB
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if admits(mid) else (mid, high)
    return high


def joined_states_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of the decode batch's image states after every join (a row's
    states concatenated with the batch's, each zero-padded to the most)."""
    seen: list[int] = []
    extend, merge = CrossAttentionStates.extend, CrossAttentionStates.merge.__func__

    def extend_spy(self: CrossAttentionStates, other: Any) -> None:
        extend(self, other)
        seen.append(self.states.nbytes if self.states is not None else 0)

    def merge_spy(cls: type, caches: list[Any]) -> CrossAttentionStates:
        merged = merge(cls, caches)
        seen.append(merged.states.nbytes if merged.states is not None else 0)
        return merged

    monkeypatch.setattr(CrossAttentionStates, "extend", extend_spy)
    monkeypatch.setattr(CrossAttentionStates, "merge", classmethod(merge_spy))
    return seen


def test_admission_prices_the_copy_a_join_makes_of_every_rows_states(
    make_pool, mllama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one mllama image row decodes, a second image request joining it makes
    the batch concatenate both rows' states (each padded to the most) beside the old
    ones: admission prices that copy before the join. The lowest hard limit that
    admits the image request, against the same prompt without its image, is higher
    by at least its image's price plus the joined states' real bytes (read from the
    batch once the two decode together)."""
    pool = make_pool(mllama_dir, fresh_profile=True, memory={"max_kv_tokens": 65536})
    probe = pool.probe = FrozenProbe()
    joined = joined_states_seen(monkeypatch)

    async def main() -> None:
        engine = await pool.get_engine("tiny-mllama")
        gate, guard = engine.gate, engine.guard
        long = image_request(engine, "long", seed=4)
        long = Request("long", long.prompt_ids, _endless(), images=long.images)
        stream = submit(engine, long)
        await stream.get()  # its first token: it decodes now
        hold = threading.Event()
        pool.worker.post(hold.wait)
        try:
            probe.held = 1 << 30
            load, limits = engine._scheduler.kv_load, guard.limits
            image = image_request(engine, "b", seed=5)
            text = Request("t", image.prompt_ids, image.sampling)

            def lowest(request: Request) -> int:
                return lowest_limit(guard, gate, probe.held, load, request, 1)

            image_price, text_price = lowest(image), lowest(text)
            encode = gate._image_bytes(image)
            guard.publish(limits)
        finally:
            probe.held = None
            hold.set()  # a failed premise fails the test: the worker must not stay blocked
        joined.clear()
        second = await collect(submit(engine, image))
        assert second and joined, joined
        assert image_price - text_price >= encode + max(joined), (
            image_price - text_price,
            encode,
            max(joined),
        )
        engine.abort("long")

    asyncio.run(main())


def _endless() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=100_000)


def left_states_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of the batch's image states after every row leaves (the other rows'
    states gathered into a new array while the old one lives)."""
    seen: list[int] = []
    keep = CrossAttentionStates.filter

    def spy(self: CrossAttentionStates, batch_indices: Any) -> None:
        before = self.states
        keep(self, batch_indices)
        if self.states is not None and self.states is not before:
            seen.append(self.states.nbytes)

    monkeypatch.setattr(CrossAttentionStates, "filter", spy)
    return seen


def test_admission_prices_the_copy_a_leaving_row_makes_of_the_others_states(
    make_pool, mllama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two mllama image rows decode; a row's leaving gathers the remaining rows' image
    states into a new array beside the old one. A text request admitted beside them is
    priced higher than beside the same batch without the second row's states (same KV,
    same reading) by at least that copy's real bytes, read when the second row leaves;
    a text row's leaving copies nothing."""
    pool = make_pool(mllama_dir, fresh_profile=True, memory={"max_kv_tokens": 65536})
    probe = pool.probe = FrozenProbe()
    left = left_states_seen(monkeypatch)

    async def main() -> None:
        engine = await pool.get_engine("tiny-mllama")
        gate, guard = engine.gate, engine.guard
        first, second = image_request(engine, "a", seed=6), image_request(engine, "b", seed=7)
        newcomer = Request("t", second.prompt_ids, second.sampling)
        for request in (first, second):
            endless = Request(
                request.request_id, request.prompt_ids, _endless(), images=request.images
            )
            await submit(engine, endless).get()  # its first token: it decodes now
        hold = threading.Event()
        pool.worker.post(hold.wait)
        limits = guard.limits
        try:
            probe.held = 1 << 30
            load = engine._scheduler.kv_load
            assert load.image_rows == 2 and load.states == 2 * load.most_states

            def lowest(load: KVLoad) -> int:
                return lowest_limit(guard, gate, probe.held, load, newcomer, 2)

            one = dataclasses.replace(load, image_rows=1, states=load.most_states)
            extra = lowest(load) - lowest(one)
        finally:
            guard.publish(limits)
            probe.held = None
            hold.set()  # a failed premise fails the test: the worker must not stay blocked

        async def leaves(rid: str, num_running: int) -> None:
            engine.abort(rid)
            while engine._scheduler.num_running > num_running:
                await asyncio.sleep(0.05)
            await asyncio.wrap_future(pool.worker.submit(lambda: None))  # its step is done

        await leaves("b", 1)  # an image row leaves: the other's states are gathered
        assert left, "no copy when an image row left"
        assert extra >= max(left), (extra, left)
        copied = list(left)
        await submit(engine, Request("u", second.prompt_ids, _endless())).get()
        await leaves("u", 1)  # a text row leaves: the states stay as they are
        assert left == copied
        engine.abort("a")

    asyncio.run(main())
