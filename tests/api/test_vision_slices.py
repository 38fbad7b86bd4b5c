"""Families whose processor gives a prompt's pixels as a list of arrays, each at its
own size (mlx-vlm's MiniCPM-V: a thumbnail and a grid of slices an image; MiniCPM-o:
each image at its own aspect; tgt_sizes and image_bound beside them).
tests/api/test_vision_families.py checks them as every family; this checks what only
they have: images of other aspects in one prompt, answered as mlx-vlm's generate
answers, and the memory gate pricing the encode from every array's own size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from omlx.api.images import ImagePart, process
from omlx.api.server import Server
from omlx.engine.gate_inputs import request_image_bytes
from omlx.engine.token_text import TokenText
from omlx.memory.vision import image_bytes, pixel_shapes, vision_transient_bytes
from omlx.models.vlm_families import FAMILIES
from omlx.scheduler import Request, SamplingParams
from tests.api.test_vision import ask, chat, png
from tests.fixtures.tiny_vlms import build_tiny_vlm

# model name -> (family, the side of a full slice in pixels)
MODELS = {
    "tiny-minicpmv4-6": ("minicpmv4_6", 112),
    "tiny-minicpmv4-7": ("minicpmv4_7", 112),
    # No slices: each image one array, resized to its own aspect.
    "tiny-minicpmo": ("minicpmo", 56),
}
MAX_TOKENS = 10
TEXT = "describe the colours and the shapes you see in these pictures, please"
# (height, width): a thumbnail alone, and a wide image: a thumbnail and three slices,
# the thumbnail's patch grid another shape than the slices'.
SIZES = [(40, 50), (120, 300)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.fixtures.servers import live_server

    root = tmp_path_factory.mktemp("tiny-vlm-slices")
    for seed, (name, (family, side)) in enumerate(MODELS.items()):
        build_tiny_vlm(root / name, family, seed=seed, image_size=side)
    with live_server(tmp_path_factory.mktemp("base"), root) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _folder(server: Server, model: str) -> Path:
    return next(i.path for i in server.pool.available().values() if i.name == model)


@pytest.mark.parametrize("model", MODELS)
def test_images_of_two_aspects_are_sliced_each_its_own_way_as_in_mlx_vlm(
    client: openai.OpenAI, server: Server, model: str, tmp_path: Path
) -> None:
    from mlx_vlm import load, stream_generate

    vlm, processor = load(str(_folder(server, model)))
    images = [tmp_path / f"{i}.png" for i in range(len(SIZES))]
    for i, (path, size) in enumerate(zip(images, SIZES, strict=True)):
        path.write_bytes(png(90 + i, size))
    marker = FAMILIES[MODELS[model][0]].image_text or processor.image_token
    prompt = f"<|im_start|>user\n{TEXT}{marker}{marker}<|im_end|>\n<|im_start|>assistant\n"
    pieces = stream_generate(
        vlm, processor, prompt, image=[str(i) for i in images], max_tokens=MAX_TOKENS, temperature=0
    )
    spell = TokenText(processor.tokenizer)
    expected = [spell.piece(p.token)[1] for p in pieces if p.finish_reason is None]
    assert len(expected) == MAX_TOKENS
    conversation = ask(*(png(90 + i, size) for i, size in enumerate(SIZES)), text=TEXT)
    reply = client.chat.completions.create(
        model=model, messages=conversation, max_tokens=MAX_TOKENS, temperature=0, logprobs=True
    )
    assert [bytes(t.bytes) for t in reply.choices[0].logprobs.content] == expected
    # The premise: one prompt's arrays of several sizes (MiniCPM-V: a thumbnail and 3
    # slices for the wide image; MiniCPM-o: each image at its aspect), which omlx took
    # as the list they are.
    out = processor(text=prompt, images=[Image.open(p).convert("RGB") for p in images])
    assert len({a.shape for a in out["pixel_values"][0]}) > 1
    assert reply.usage.prompt_tokens == out["input_ids"].shape[1]


def test_the_memory_gate_prices_the_encode_from_every_slices_own_size(
    client: openai.OpenAI, server: Server
) -> None:
    # Each slice goes through the tower apart, at its own patch grid (tgt_sizes): the
    # gate's price is the formula over those arrays (the tower's part of each summed,
    # the prompt's embeddings once), scaled by the load's image pass, not one array's.
    model = "tiny-minicpmv4-6"
    chat(client, model, [{"role": "user", "content": "hi"}], 1)  # loads it
    engine = next(e for e in server.pool.loaded() if e.name == model)
    vision, guard = engine.loaded.vision, engine.guard
    parts = [ImagePart(png(90 + i, size), f"image {i}") for i, size in enumerate(SIZES)]
    text = f"{TEXT}{vision.image_text}{vision.image_text}"
    ids, images = process(vision.processor, text, parts, vision.image_token_id, vision.prompt_ids)
    request = Request("priced", tuple(ids), SamplingParams(max_tokens=1), images=images)
    grids = np.concatenate(images.extras["tgt_sizes"])
    patch = vision.dims.patch_size
    # A slice as the tower takes it: its patches packed in one row (3, patch, patches x patch).
    slices = [(1, 3, patch, patch * int(h) * int(w)) for h, w in grids]
    assert len(slices) == 5 and len(set(slices)) == 2  # the premise: two sizes of slice
    assert list(pixel_shapes(images.pixel_values)) == slices
    price = request_image_bytes(vision, guard, request)
    assert price == image_bytes(vision.dims, slices, len(ids), guard.profile)
    tokens = len(ids)
    each = [vision_transient_bytes(vision.dims, s, tokens) for s in slices]
    embeddings = tokens * vision.dims.text_hidden_size * vision.dims.dtype_bytes
    assert image_bytes(vision.dims, slices, tokens, None) == sum(each) - 4 * embeddings


def test_an_image_marker_the_text_writes_is_a_clear_400(client: openai.OpenAI) -> None:
    # MiniCPM-V 4.7's processor counts the prompt's <|image_pad|> markers against its
    # images and raises ValueError: a 400 saying so, not an internal error.
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "tiny-minicpmv4-7", ask(png(74), text=f"what is <|image_pad|> {TEXT}"), 1)
    message = info.value.response.json()["error"]["message"]
    assert "processor refused the prompt's 1 image(s)" in message
    assert "placeholders must match" in message and "remove it from the text" in message
