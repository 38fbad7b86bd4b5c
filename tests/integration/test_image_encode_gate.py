"""Issue 40, item 1: a prompt's image encode (the vision tower runs when the
request starts) passes the forward gate with a fresh reading before it runs.
While another model's work holds the memory it needs, the request waits (not
ended: at its encode's gate, or already at admission, which counts every model's
work in flight) and the encode does not run; once memory frees, it completes."""

from __future__ import annotations

import asyncio
import io
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omlx.api.images import ImagePart, process
from omlx.engine.stream import RequestStream
from omlx.errors import MemoryPressureError
from omlx.memory.budget import Limits, MemoryReading
from omlx.memory.vision import image_bytes, pixel_shapes
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.frozen_probe import FrozenProbe
from tests.fixtures.tiny_vlms import build_tiny_vlm

MB = 1_000_000
MARGIN = 64 * MB
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture
def models_dir(tiny_models_dir: Path, tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(tiny_models_dir / "tiny-llama", root / "tiny-llama")
    # 112-pixel images (64 image tokens): the tower's encode outweighs the prompt's
    # first chunk with its cache's growth step (the premise `_tight` checks).
    build_tiny_vlm(root / "tiny-llava", "llava", seed=0, image_size=112)
    return root


def _image_request(engine: Any, rid: str) -> Request:
    vision = engine.loaded.vision
    pixels = np.random.default_rng(0).integers(0, 256, (2, 2, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).resize((28, 28), Image.Resampling.NEAREST).save(png, "PNG")
    text = f"look: {vision.image_text} what is it?"
    part = ImagePart(png.getvalue(), "image")
    ids, images = process(vision.processor, text, [part], vision.image_token_id, vision.prompt_ids)
    return Request(rid, tuple(ids), GREEDY, images=images)


def _encodes_seen_by(engine: Any, probe: FrozenProbe) -> list[int | None]:
    """The bytes the probe held at each run of the model's vision tower (a probe
    on mlx-vlm's public ``get_input_embeddings``, installed on this instance)."""
    model, seen = engine.loaded.vision.model, []
    tower = model.get_input_embeddings

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(probe.held)
        return tower(*args, **kwargs)

    model.get_input_embeddings = watched
    return seen


def _tight(engine: Any, request: Request, held: int) -> Limits:
    """The lowest ceiling under which the image prompt's first prefill chunk fits
    with ``held`` bytes held; its image encode must not fit under it."""
    reading = MemoryReading(held, held, held, taken_at_s=0.0)
    guard, tokens = engine.guard, request.num_prompt_tokens

    def fits(hard: int) -> bool:
        guard.publish(Limits(hard, hard, MARGIN))
        return bool(guard.gate(tokens, 0, reading, others=False))

    low, high = held, held + 10_000 * MB
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    pixels = pixel_shapes(request.images.pixel_values)
    vision = image_bytes(engine.loaded.vision.dims, pixels, tokens, guard.profile)
    encode = guard.unmodeled_bytes + vision
    assert held + encode + MARGIN > high, "the ceiling would pass the image encode"
    return Limits(high, high, MARGIN)


async def _collect(stream: RequestStream) -> str:
    text = ""
    while True:
        event = await stream.get()
        assert event.error is None, event.error
        text += event.text
        if event.finish_reason:
            return text


def test_an_image_encode_waits_for_memory_another_model_holds(make_pool, models_dir) -> None:
    async def main() -> None:
        pool = make_pool(models_dir, fresh_profile=True)
        probe = pool.probe = FrozenProbe()
        text_engine = await pool.get_engine("tiny-llama")
        engine = await pool.get_engine("tiny-llava")
        request = _image_request(engine, "picture")
        roomy = await _collect(_submit(engine, _image_request(engine, "roomy")))
        encodes = _encodes_seen_by(engine, probe)

        # The other model decodes on; while it does, the memory it holds leaves
        # no room for the encode (the prompt's chunk alone would fit).
        other = _submit(text_engine, Request("other", tuple(range(3, 40)), _long()))
        await other.get()
        hold = threading.Event()
        pool.worker.post(hold.wait)
        try:
            image = _submit(engine, request)
            tight_at = probe.held = probe.reading().resident_bytes + 300 * MB
            pool.limits = _tight(engine, request, tight_at)
            engine.guard.publish(pool.limits)
            text_engine.guard.publish(pool.limits)
        finally:
            hold.set()  # a failed premise fails the test: the worker must not stay blocked
        task = asyncio.create_task(_collect(image))
        for _ in range(500):
            if engine.gate.num_held_encodes or task.done():
                break
            await asyncio.sleep(0.01)
        # It waits: held at its encode, or (the process's work counted at admission,
        # issue 40 #3) kept queued before it ever starts.
        waited = engine.gate.num_held_encodes + engine.gate.deferrals["memory"]
        assert waited > 0 and not task.done()

        probe.held = tight_at - 200 * MB  # the other work freed memory
        assert await task == roomy
        assert encodes and all(held != tight_at for held in encodes), encodes
        assert engine.num_gated == 0
        text_engine.abort("other")

    asyncio.run(main())


def _submit(engine: Any, request: Request) -> RequestStream:
    stream = RequestStream(request.request_id, asyncio.get_running_loop())
    engine.submit(request, stream)
    return stream


def _long() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=100_000)


def test_an_image_encode_that_cannot_fit_alone_ends_its_request(make_pool, models_dir) -> None:
    """Nothing else runs to free memory: the request is ended with the gate's
    retryable error, before its vision tower runs."""

    async def main() -> None:
        pool = make_pool(models_dir, fresh_profile=True)
        probe = pool.probe = FrozenProbe()
        engine = await pool.get_engine("tiny-llava")
        encodes = _encodes_seen_by(engine, probe)
        request = _image_request(engine, "alone")
        hold = threading.Event()
        pool.worker.post(hold.wait)
        try:
            stream = _submit(engine, request)
            probe.held = probe.reading().resident_bytes
            pool.limits = _tight(engine, request, probe.held)
            engine.guard.publish(pool.limits)
        finally:
            hold.set()  # a failed premise fails the test: the worker must not stay blocked
        event = await stream.get()
        assert isinstance(event.error, MemoryPressureError), event
        assert encodes == [] and engine.num_gated == 1 and engine.gate.num_held_encodes == 1

    asyncio.run(main())
