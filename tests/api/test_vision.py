"""Vision-language chat on tiny random VLMs of four mlx-vlm families (llava,
pixtral, qwen2_vl, qwen2_5_vl), through the official openai and anthropic clients
on a live server."""

from __future__ import annotations

import base64
import dataclasses
import gc
import io
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
from PIL import Image

from omlx.api.server import Server
from omlx.memory.vision import vision_transient_bytes
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_models import build_tiny_model
from tests.fixtures.tiny_vlms import build_tiny_vlm

VLMS = ["tiny-llava", "tiny-pixtral", "tiny-qwen2-vl", "tiny-qwen25-vl"]
BIG = "tiny-llava-336"  # 576 image tokens per image: for the memory guard


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("tiny-vlms")
    build_tiny_vlm(root / "tiny-llava", "llava", seed=0)
    build_tiny_vlm(root / "tiny-pixtral", "pixtral", seed=1)
    build_tiny_vlm(root / BIG, "llava", seed=2, image_size=336)
    # M-RoPE: a 40x50 image is 12 tokens on a 3x4 grid, 8 positions fewer than tokens.
    build_tiny_vlm(root / "tiny-qwen2-vl", "qwen2_vl", seed=3, image_size=84)
    build_tiny_vlm(root / "tiny-qwen25-vl", "qwen2_5_vl", seed=4, image_size=84)
    build_tiny_model(root / "tiny-llama", "llama", seed=0)
    # A family not served (florence2: not a chat model): discovered as a VLM, not loaded.
    florence2 = root / "tiny-florence2"
    florence2.mkdir()
    (florence2 / "config.json").write_text('{"model_type": "florence2", "vision_config": {}}')
    (florence2 / "model.safetensors").write_bytes(b"\0" * 64)
    with live_server(
        tmp_path_factory.mktemp("base"),
        root,
        scheduler={"max_concurrent_requests": 8, "prefill_step_size": 64},
        models={"image_url_allowlist": ["127.0.0.1"]},
    ) as srv:
        yield srv


class _Images(BaseHTTPRequestHandler):
    """Serves /cat.png, a too-large /big.png, a redirect and 404s."""

    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = {"/cat.png": png(130), "/big.png": b"\0" * (21 * 2**20)}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def png(seed: int, size: tuple[int, int] = (40, 50)) -> bytes:
    """Four quadrants of random colours (each survives the resize to a few patches)."""
    quadrants = np.random.default_rng(seed).integers(0, 256, (2, 2, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(quadrants).resize((size[1], size[0]), Image.Resampling.NEAREST).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def ask(*images: bytes, text: str = "what is in the picture?") -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": parts}]


def chat(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int = 8):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )


def error_of(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_models_show_kind_vlm_and_the_vision_capability(
    client: openai.OpenAI, server: Server
) -> None:
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    for name in VLMS:
        assert listed[name]["kind"] == "vlm"
        assert "vision" in listed[name]["capabilities"]
    assert listed["tiny-llama"]["kind"] == "llm"
    assert "vision" not in listed["tiny-llama"]["capabilities"]
    # The admin panel's models list, and Ollama's /api/show.
    status = {m["name"]: m for m in server.pool.status()}
    assert (
        status["tiny-llava"]["kind"] == "vlm" and "vision" in status["tiny-llava"]["capabilities"]
    )
    shown = ollama.Client(host=server.base_url).show("tiny-pixtral")
    assert "vision" in (shown.capabilities or [])


@pytest.mark.parametrize("model", VLMS)
def test_the_image_changes_the_answer(client: openai.OpenAI, server: Server, model: str) -> None:
    first = chat(client, model, ask(png(1))).choices[0].message.content
    other = chat(client, model, ask(png(2))).choices[0].message.content
    text_only = chat(client, model, [{"role": "user", "content": "what is in the picture?"}])
    assert first != other
    assert text_only.choices[0].message.content not in (first, other)
    # The memory guard prices the language model from the nested text_config.
    engine = next(e for e in server.pool.loaded() if e.name == model)
    assert (engine.guard.dims.num_layers, engine.guard.dims.hidden_size) == (2, 64)
    # The pool's weights budget counts every weight: the vision tower's too.
    import mlx.core as mx

    weights = mx.load(str(engine.loaded.info.path / "model.safetensors"))
    held = next(m for m in server.pool.status() if m["name"] == model)["memory_bytes"]
    assert held == sum(w.nbytes for w in weights.values())


@pytest.mark.parametrize("model", VLMS)
def test_a_repeated_image_is_a_cache_hit_with_the_same_answer(
    client: openai.OpenAI, model: str
) -> None:
    messages = ask(png(10 + VLMS.index(model)))
    first = chat(client, model, messages)
    again = chat(client, model, messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    # Same tokens, another image: no hit past the images (their hashes key the blocks).
    other = chat(client, model, ask(png(20 + VLMS.index(model))))
    assert other.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("model", VLMS)
def test_batched_answers_equal_solo_answers(client: openai.OpenAI, model: str) -> None:
    conversations = [
        ask(png(30), text="describe it"),
        ask(png(31), png(32), text="compare them"),
        [{"role": "user", "content": "tell me a story"}],
        ask(png(33), text="and this one?"),
    ]
    solo = [chat(client, model, m, 12).choices[0].message.content for m in conversations]
    with ThreadPoolExecutor(len(conversations)) as pool:
        batched = list(pool.map(lambda m: chat(client, model, m, 12), conversations))
    assert [r.choices[0].message.content for r in batched] == solo


@pytest.mark.parametrize("model", VLMS)
def test_image_choices_and_logprobs_match_the_plain_answer(
    client: openai.OpenAI, model: str
) -> None:
    messages = ask(png(34), text="describe it")
    plain = chat(client, model, messages, 8).choices[0].message.content
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, n=2, logprobs=True
    )
    assert [c.message.content for c in reply.choices] == [plain, plain]
    for choice in reply.choices:
        tokens = choice.logprobs.content
        # By bytes: a token may be part of a character (the answer shows it as U+FFFD).
        spelled = b"".join(bytes(t.bytes) for t in tokens).decode("utf-8", errors="replace")
        assert tokens and spelled.startswith(plain[:4])
        assert all(t.logprob <= 0.0 for t in tokens)


def test_anthropic_image_blocks_answer(server: Server) -> None:
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    image = png(40)
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(image).decode(),
        },
    }
    content = [{"type": "text", "text": "what is in the picture?"}, block]
    answers = [
        claude.messages.create(
            model="tiny-llava",
            max_tokens=8,
            messages=[{"role": "user", "content": content}],
            extra_body={"temperature": 0},
        )
        for _ in range(2)
    ]
    first, again = answers
    assert first.stop_reason == "max_tokens" and first.content[0].type == "text"
    assert first.content[0].text  # type: ignore[union-attr]
    assert again.content == first.content
    assert (again.usage.cache_read_input_tokens or 0) > 0


def _bad(server: Server, content_part: dict, model: str = "tiny-llava") -> httpx.Response:
    body = {
        "model": model,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, content_part]}],
    }
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64,not*base64", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "decoded"),
        ("https://example.com/cat.png", "data URL"),
        ("cat.png", "data URL"),
    ],
)
def test_bad_images_are_400_naming_the_part(server: Server, url: str, says: str) -> None:
    answer = _bad(server, _image_part(url))
    assert answer.status_code == 400, answer.text
    err = answer.json()["error"]
    assert err["param"] == "messages[0].content[1]" and says in err["message"]


def test_an_image_with_too_many_pixels_is_400(server: Server) -> None:
    huge = io.BytesIO()
    Image.new("RGB", (5000, 4000)).save(huge, "PNG")  # ~60 KB, 20 megapixels
    answer = _bad(server, _image_part(data_url(huge.getvalue())))
    assert answer.status_code == 400, answer.text
    assert "5000x4000" in answer.json()["error"]["message"]


def test_too_many_images_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "tiny-llava", ask(*[png(50 + i) for i in range(9)]))
    err = error_of(info.value)
    assert err["param"] == "messages[0].content[9]" and "at most 8 images" in err["message"]


def test_a_text_model_given_an_image_keeps_its_clear_400(server: Server) -> None:
    answer = _bad(server, _image_part(data_url(png(60))), model="tiny-llama")
    text = answer.json()["error"]["message"]
    assert answer.status_code == 400
    assert "messages[0].content[1]" in text and "text model" in text, text
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    image = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png(60)).decode(),
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model="tiny-llama",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": image}]}],
        )
    message = info.value.response.json()["error"]["message"]
    assert "messages[0].content[0]" in message and "text model" in message


def test_the_guard_refuses_an_image_set_that_can_never_fit(
    client: openai.OpenAI, server: Server
) -> None:
    chat(client, BIG, ask(png(70)), max_tokens=1)  # loaded
    engine = next(e for e in server.pool.loaded() if e.name == BIG)
    guard = engine.guard
    # Room for one 336-pixel image (576 tokens, a few MiB to encode) beside the model
    # and the margin, not for seven (their vision transient alone is ~34 MiB).
    room = guard.baseline_bytes + guard.limits.transient_margin_bytes + 16 * 2**20
    with _limited(server, guard, int(room / 0.98) + 1) as ceiling:
        # One image passes this front door (the check submit makes; first, as the
        # 7-image render below moves this process's live baseline up).
        one_image = vision_transient_bytes(engine.loaded.vision.dims, (1, 3, 336, 336), 600)
        guard.check_prefill(600, image_bytes=one_image)
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, BIG, ask(*[png(80 + i) for i in range(7)]), max_tokens=1)
        err = error_of(info.value)
        assert err["code"] == "prefill_memory_exceeded"
        assert err["estimated_bytes"] > err["limit_bytes"] == ceiling
        assert "images" in err["message"]
    # And runs: its prefill chunks are gated on fresh readings of this process, which
    # the test's own allocations (images decoded, the 7-image render) move past the
    # load-time baseline, so give it room above the process as it is now.
    now = engine.probe.reading(fresh=True).resident_bytes
    room = now + guard.limits.transient_margin_bytes + 64 * 2**20
    with _limited(server, guard, int(room / 0.98) + 1):
        one = chat(client, BIG, ask(png(90)), max_tokens=2)
        assert one.choices[0].finish_reason == "length"


def test_the_auto_profile_measures_an_image_pass_and_the_front_door_uses_it(
    client: openai.OpenAI, server: Server
) -> None:
    chat(client, BIG, ask(png(71)), max_tokens=1)  # loaded
    engine = next(e for e in server.pool.loaded() if e.name == BIG)
    guard, vision = engine.guard, engine.loaded.vision
    profile = guard.profile
    ids, pixels, _ = vision.stress_inputs()
    assert pixels.shape == (1, 3, 336, 336)  # one image at the processor's size
    assert profile.image_estimate_bytes == vision_transient_bytes(
        vision.dims, pixels.shape, len(ids)
    )
    # Encoding 576 patches allocates more than the pixels (activations, scores, embeddings).
    assert profile.image_peak_bytes > pixels.nbytes
    shown = {
        m["name"]: m for m in httpx.get(server.base_url + "/admin/api/models").json()["models"]
    }
    assert shown[BIG]["kv_profile"]["image_peak_bytes"] == profile.image_peak_bytes
    # On a machine where encoding took 32x the formula, one image that fits by the
    # formula (4x over) is refused at the front door: the measurement prices it.
    one_image = vision_transient_bytes(vision.dims, (1, 3, 336, 336), 600)
    # The live baseline follows the process down (it never exceeds the reading), so
    # memory freed after ``room`` is read leaves more room: settle earlier tests'
    # garbage first, and price the image far past the room (28 images' worth).
    gc.collect()
    room = guard.baseline_bytes + guard.limits.transient_margin_bytes + 4 * one_image
    heavy = dataclasses.replace(profile, image_peak_bytes=32 * profile.image_estimate_bytes)
    with _limited(server, guard, int(room / 0.98) + 1):
        guard.check_prefill(600, image_bytes=one_image)  # fits by the formula
        guard.set_profile(heavy)
        try:
            with pytest.raises(openai.BadRequestError) as info:
                chat(client, BIG, ask(png(72)), max_tokens=1)
        finally:
            guard.set_profile(profile)
        err = error_of(info.value)
        assert err["code"] == "prefill_memory_exceeded" and "images" in err["message"]


@contextmanager
def _limited(server: Server, guard: Any, ceiling: int) -> Iterator[int]:
    """The hard limit at ``ceiling`` for the block: the pool's too, since the
    enforcer publishes the pool's limits to every guard each poll."""
    pool_limits = server.pool.limits
    server.pool.limits = dataclasses.replace(pool_limits, hard_bytes=ceiling)
    guard.publish(dataclasses.replace(guard.limits, hard_bytes=ceiling))
    try:
        yield ceiling
    finally:
        server.pool.limits = pool_limits
        server.pool.publish_limits()  # every guard, as the enforcer's next poll would


def test_responses_input_image_answers_and_a_repeat_is_cached(client: openai.OpenAI) -> None:
    content = [
        {"type": "input_text", "text": "what is in the picture?"},
        {"type": "input_image", "image_url": data_url(png(110))},
    ]
    kw = {"model": "tiny-llava", "max_output_tokens": 8, "temperature": 0}
    first = client.responses.create(input=[{"role": "user", "content": content}], **kw)
    again = client.responses.create(input=[{"role": "user", "content": content}], **kw)
    assert first.output_text and again.output_text == first.output_text
    assert again.usage.input_tokens_details.cached_tokens > 0
    # The same words with another image answer differently (the image reached the model).
    content[1]["image_url"] = data_url(png(111))
    other = client.responses.create(input=[{"role": "user", "content": content}], **kw)
    assert other.output_text != first.output_text


def test_a_stored_image_is_still_seen_by_a_previous_response_id_follow_up(
    client: openai.OpenAI,
) -> None:
    image = data_url(png(112))
    content = [
        {"type": "input_text", "text": "what is in the picture?"},
        {"type": "input_image", "image_url": image},
    ]
    kw = {"model": "tiny-llava", "max_output_tokens": 6, "temperature": 0}
    first = client.responses.create(input=[{"role": "user", "content": content}], **kw)
    follow = client.responses.create(input="and the colours?", previous_response_id=first.id, **kw)
    # The same conversation sent whole, image included.
    whole = client.responses.create(
        input=[
            {"role": "user", "content": content},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and the colours?"},
        ],
        store=False,
        **kw,
    )
    # The same prompt, image tokens included (a dropped image would be a 400 or fewer
    # tokens); outputs are not compared: a tiny random model's near-flat logits flip
    # between a cached and an uncached prefill.
    assert follow.output_text and follow.usage.input_tokens == whole.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the first turn reused
    items = client.responses.input_items.list(follow.id).data
    parts = [p for item in items if isinstance(item.content, list) for p in item.content]
    assert [p.image_url for p in parts if p.type == "input_image"] == [image]


def test_responses_bad_input_image_is_400_naming_the_part(client: openai.OpenAI) -> None:
    bad = [{"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "x.png"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny-llava", input=[{"role": "user", "content": bad}])
    assert error_of(info.value)["param"] == "input[0].content[1]"
    with pytest.raises(openai.BadRequestError) as info:  # a text model: its clear 400
        client.responses.create(
            model="tiny-llama",
            input=[
                {"role": "user", "content": [bad[0], {**bad[1], "image_url": data_url(png(1))}]}
            ],
        )
    assert "input_image" in error_of(info.value)["message"]


def test_ollama_images_answer(server: Server) -> None:
    llama = ollama.Client(host=server.base_url)
    image = png(120)
    options = {"temperature": 0, "num_predict": 6}
    ask_ = [{"role": "user", "content": "what is this?", "images": [image]}]
    first = llama.chat(model="tiny-llava", messages=ask_, options=options)
    again = llama.chat(model="tiny-llava", messages=ask_, options=options)
    assert first.message.content and again.message.content == first.message.content
    other = llama.chat(
        model="tiny-llava", messages=[{**ask_[0], "images": [png(121)]}], options=options
    )
    assert other.message.content != first.message.content
    generated = llama.generate(
        model="tiny-llava", prompt="what is this?", images=[image], options=options
    )
    assert generated.response and generated.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as info:
        llama.generate(model="tiny-llava", prompt="hi", images=[b"not an image"])
    assert info.value.status_code == 400 and "images[0]" in info.value.error


def test_an_allowed_image_url_is_fetched_and_keyed_by_its_bytes(
    client: openai.OpenAI, image_host: int
) -> None:
    inline = chat(client, "tiny-llava", ask(png(130)))
    url = [
        {"type": "text", "text": "what is in the picture?"},
        {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{image_host}/cat.png"}},
    ]
    fetched = chat(client, "tiny-llava", [{"role": "user", "content": url}])
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    # The same bytes, however they came: the prefix cache holds the image's tokens.
    assert fetched.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("http://localhost:{port}/cat.png", "image_url_allowlist"),  # host not allowed
        ("http://127.0.0.1:{port}/big.png", "larger than 20 MiB"),
        ("http://127.0.0.1:{port}/missing.png", "HTTP 404"),
        ("http://127.0.0.1:{port}/redirect", "HTTP 302"),  # redirects are not followed
    ],
)
def test_image_urls_that_cannot_be_fetched_are_400_naming_the_part(
    server: Server, image_host: int, where: str, says: str
) -> None:
    answer = _bad(server, _image_part(where.format(port=image_host)))
    assert answer.status_code == 400, answer.text
    err = answer.json()["error"]
    assert err["param"] == "messages[0].content[1]" and says in err["message"]


def _reference_answer(folder: Path, text: str, image: bytes, max_tokens: int) -> str:
    """Greedy decoding with mlx-vlm's own model object, the whole prompt in one
    forward (no chunks, no batch, no cache reuse): what the engine must match."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm import load

    from omlx.api.images import ImagePart, process

    model, processor = load(str(folder))
    qwen = model.config.model_type in ("qwen2_vl", "qwen2_5_vl")
    image_id = model.config.image_token_id if qwen else model.config.image_token_index
    marker = "<|vision_start|><|image_pad|><|vision_end|>" if qwen else processor.image_token
    prompt = f"<|im_start|>user\n{text}{marker}<|im_end|>\n<|im_start|>assistant\n"
    # The processor's ids as they are: the model given them embeds one row a token.
    ids, images = process(processor, prompt, [ImagePart(image, "x")], image_id, lambda i, *_: i)
    extras = {k: mx.array(v) for k, v in images.extras.items()}
    features = model.get_input_embeddings(
        mx.array(ids)[None], mx.array(images.pixel_values), **extras
    )
    language = model.language_model
    cache = make_prompt_cache(language)
    # Qwen2-VL: mlx-vlm's own M-RoPE positions (unshifted), its decode from the deltas
    # the model keeps.
    rope = {"position_ids": features.position_ids, "rope_deltas": features.rope_deltas}
    logits = language(
        mx.array(ids)[None], inputs_embeds=features.inputs_embeds, cache=cache,
        **(rope if qwen else {}),
    )  # fmt: skip
    out: list[int] = []
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    while len(out) < max_tokens:
        token = int(mx.argmax(logits.logits[0, -1]).item())
        if token == eos:
            break
        out.append(token)
        logits = language(mx.array([[token]]), cache=cache)
    return str(processor.tokenizer.decode(out))


@pytest.mark.parametrize(
    "model", ["tiny-llava-336", "tiny-pixtral", "tiny-qwen2-vl", "tiny-qwen25-vl"]
)
def test_answers_match_mlx_vlm_run_in_one_forward(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    # tiny-llava-336's 576 image tokens prefill in 10 chunks of 64 on the engine.
    image, text = png(140), "what is in the picture?"
    folder = next(info.path for info in server.pool.available().values() if info.name == model)
    expected = _reference_answer(folder, text, image, 10)
    got = chat(client, model, ask(image, text=text), max_tokens=10)
    assert got.choices[0].message.content == expected


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen25-vl"])
def test_qwen_image_tokens_across_prefill_chunks_match_mlx_vlm(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    # ~50 text tokens then 36 image tokens on a 6x6 grid: the 64-token chunks cut the
    # image, whose M-RoPE positions each chunk takes from the prompt's table.
    image, text = png(141, size=(300, 300)), "describe the colours and the shapes " * 6
    folder = next(i.path for i in server.pool.available().values() if i.name == model)
    expected = _reference_answer(folder, text, image, 10)
    got = chat(client, model, ask(image, text=text), max_tokens=10)
    assert got.usage.prompt_tokens > 64
    assert got.choices[0].message.content == expected


def test_a_vlm_family_not_served_is_a_clear_load_error(client: openai.OpenAI) -> None:
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert listed["tiny-florence2"]["kind"] == "vlm"
    with pytest.raises(openai.APIStatusError) as info:
        chat(client, "tiny-florence2", ask(png(150)))
    message = error_of(info.value)["message"]
    assert "florence2" in message and "not supported" in message and "qwen3_vl" in message
    assert "not a chat model" in message  # the reason (vlm_refusals.REFUSED)
