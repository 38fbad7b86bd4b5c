"""A whole prompt (an image prompt, or paligemma's text one) under a memory ceiling
(issue 41).

mlx-vlm prefills a whole-prompt family's image prompt (paligemma's bidirectional
attention, mllama, gemma4's bidirectional images) in one forward, paligemma's text-only
prompt too, and its tokens attend as that forward lets them: prefilled in chunks, its
answer can differ. The memory guard prices such a prompt as one forward at the front
door and at admission, and its forward gate runs it whole, holds it, or ends it, never
caps it into chunks. These tests run tiny-paligemma on the real path under ceilings
read from the guard's own figures (a chunked prefill fits them, the one forward does not).
"""

from __future__ import annotations

import asyncio
import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omlx.api.images import ImagePart, process
from omlx.engine.gate_inputs import request_image_bytes
from omlx.errors import OmlxError, PrefillMemoryExceededError
from omlx.memory.budget import Limits
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.frozen_probe import FrozenProbe
from tests.fixtures.tiny_vlms import build_tiny_vlm
from tests.integration.test_image_encode_gate import _submit as submit

MAX_TOKENS = 6
STEP = 32  # the prefill step: the prompt below is several of them
MB = 1_000_000


@pytest.fixture(scope="module")
def paligemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("whole-prompt")
    build_tiny_vlm(root / "tiny-paligemma", "paligemma", seed=4, image_size=28)
    return root


def image_request(engine: Any, rid: str) -> Request:
    vision = engine.loaded.vision
    pixels = np.random.default_rng(5).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).resize((28, 28), Image.Resampling.NEAREST).save(png, "PNG")
    text = vision.image_text + "describe the colours and the shapes you see " * 40
    part = ImagePart(png.getvalue(), "image")
    ids, images = process(vision.processor, text, [part], vision.image_token_id, vision.prompt_ids)
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return Request(rid, tuple(ids), sampling, images=images)


def text_request(engine: Any, rid: str) -> Request:
    """A long text-only prompt: paligemma's model attends it whole too
    (Family.whole_text_prompt)."""
    tokenizer = engine.loaded.vision.processor.tokenizer
    ids = tokenizer.encode("describe the colours and the shapes of a garden " * 40)
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return Request(rid, tuple(ids), sampling)


PROMPTS = {"image": image_request, "text": text_request}


async def outcome(engine: Any, request: Request) -> tuple[str, int] | OmlxError:
    """The request's text and output tokens, or the error it ended with."""
    stream, text = submit(engine, request), ""
    while True:
        event = await stream.get()
        if event.error is not None:
            return event.error
        text += event.text
        if event.finish_reason:
            return text, event.num_output_tokens


def lowest_hard(passes: Any, low: int, high: int) -> int:
    """The lowest hard limit in (low, high] at which ``passes(hard)``."""
    assert passes(high) and not passes(low)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if passes(mid) else (mid, high)
    return high


@pytest.mark.parametrize("kind", PROMPTS)
def test_the_front_door_prices_a_whole_prompt_as_one_forward(
    make_pool, paligemma_dir: Path, kind: str
) -> None:
    """Under a ceiling its chunked prefill would fit but its one forward does not, the
    prompt (with an image, or text alone) is refused at once (400, saying why and what
    helps), not queued to be prefilled in chunks; without the ceiling it is served."""
    make_request = PROMPTS[kind]
    pool = make_pool(
        paligemma_dir,
        memory={"max_kv_tokens": 65536, "max_process_memory": "6GB"},
        prefill_step_size=STEP,
    )

    async def main() -> None:
        engine = await pool.get_engine("tiny-paligemma")
        guard, request = engine.guard, make_request(engine, "free")
        assert request.num_prompt_tokens > 2 * STEP
        free = await outcome(engine, request)
        assert isinstance(free, tuple) and free[1] == MAX_TOKENS
        limits, n = guard.limits, request.num_prompt_tokens
        image = request_image_bytes(engine.loaded.vision, guard, request)

        def fits(one_forward: bool) -> Any:
            def passes(hard: int) -> bool:
                guard.publish(Limits(hard, hard, limits.transient_margin_bytes))
                try:
                    guard.check_prefill(n, image_bytes=image, one_forward=one_forward)
                except PrefillMemoryExceededError:
                    return False
                return True

            return passes

        try:
            chunked = lowest_hard(fits(False), 0, limits.hard_bytes)
            whole = lowest_hard(fits(True), 0, limits.hard_bytes)
            # The premise: the one forward needs more (by more than the baseline moves).
            assert whole - chunked > MB, (chunked, whole)
            between = (chunked + whole) // 2
            guard.publish(Limits(between, between, limits.transient_margin_bytes))
            with pytest.raises(
                PrefillMemoryExceededError, match="prefilled in one forward"
            ) as error:
                submit(engine, make_request(engine, "chunked"))
            assert "prefill_step_size does not help" in str(error.value)
        finally:
            guard.publish(limits)
        assert await outcome(engine, make_request(engine, "whole")) == free

    asyncio.run(main())


def test_the_forward_gate_never_caps_a_whole_prompt_image_prompt_into_chunks(
    make_pool, paligemma_dir: Path
) -> None:
    """Under a reading at which a prefill step's chunk fits but the prompt's one
    forward does not, the lone image prompt is ended with the gate's retryable error
    (nothing else runs to free memory), not prefilled in chunks into another answer;
    with the memory back, it is served as under no ceiling."""
    pool = make_pool(
        paligemma_dir,
        fresh_profile=True,
        memory={"max_kv_tokens": 65536, "max_process_memory": "6GB"},
        prefill_step_size=STEP,
    )
    probe = pool.probe = FrozenProbe()

    async def main() -> None:
        engine = await pool.get_engine("tiny-paligemma")
        gate, guard = engine.gate, engine.guard
        free = await outcome(engine, image_request(engine, "free"))
        n, limits = image_request(engine, "n").num_prompt_tokens, guard.limits
        probe.held = guard.baseline_bytes + (16 << 30)  # above what the front door prices
        reading = probe.reading(fresh=True)

        def fits(tokens: int) -> Any:
            def passes(hard: int) -> bool:
                guard.publish(Limits(hard, hard, limits.transient_margin_bytes))
                return guard.gate(tokens, 0, reading, others=False)

            return passes

        def encodes(hard: int) -> bool:
            guard.publish(Limits(hard, hard, limits.transient_margin_bytes))
            return gate.may_encode(image_request(engine, "e"), 0) == "run"

        try:
            hard = max(
                lowest_hard(fits(STEP), probe.held, 64 * probe.held),
                lowest_hard(encodes, probe.held, 64 * probe.held),
            )
            # The premise: the encode and a step's chunk fit, the one forward does not.
            assert not fits(n)(hard)
            guard.publish(Limits(hard, hard, limits.transient_margin_bytes))
            gated = gate.num_gated
            # Past the front door on the real baseline, then the reading rises.
            hold = threading.Event()
            pool.worker.post(hold.wait)
            frozen, probe.held = probe.held, None
            started = asyncio.ensure_future(outcome(engine, image_request(engine, "capped")))
            await asyncio.sleep(0)  # submitted: the front door passed
            probe.held = frozen
            hold.set()
            ended = await started
            assert isinstance(ended, OmlxError) and "memory" in str(ended), ended
            assert gate.num_gated == gated + 1
        finally:
            guard.publish(limits)
            probe.held = None
        assert await outcome(engine, image_request(engine, "again")) == free

    asyncio.run(main())
