"""More mlx-vlm families (issue 41, defect 6), each a tiny random model served by a
live server and checked against mlx-vlm's own ``stream_generate`` (greedy) on the
same image and prompt: alone, streamed, four image requests at once, and a repeated
image prompt served from the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from omlx.api.server import Server
from omlx.engine.engine_status import engine_status
from omlx.engine.token_text import TokenText
from omlx.errors import ModelLoadError
from omlx.models.discovery import ModelInfo
from omlx.models.vlm import load_vlm
from omlx.models.vlm_families import ALIASES, FAMILIES, REFUSED
from omlx.models.vlm_families import family as family_of
from omlx.models.vlm_processors import served_processor
from tests.api.test_vision import ask, chat, png
from tests.fixtures.tiny_vlms import build_tiny_vlm

# model name -> (family, the processor's image side, why it runs one at a time or None)
MODELS: dict[str, tuple[str, int, str | None]] = {
    "tiny-gemma3": ("gemma3", 56, None),
    "tiny-idefics3": ("idefics3", 56, None),
    "tiny-smolvlm": ("smolvlm", 56, None),
    "tiny-qwen3-vl": ("qwen3_vl", 96, None),
    "tiny-paligemma": ("paligemma", 28, "bidirectional"),
    "tiny-mllama": ("mllama", 28, "cross-attention"),
    # Families added since (after the first ones, so theirs keep their seeds).
    "tiny-idefics2": ("idefics2", 56, None),
    "tiny-qwen3-vl-moe": ("qwen3_vl_moe", 96, None),
    "tiny-aya-vision": ("aya_vision", 56, None),
    "tiny-llava-onevision": ("llava_onevision", 28, None),
    "tiny-internvl": ("internvl_chat", 56, None),
    "tiny-internvl-hf": ("internvl", 56, None),
    "tiny-kimi-vl": ("kimi_vl", 28, None),
    "tiny-kimi-k25": ("kimi_k25", 28, None),
    "tiny-glm4v": ("glm4v", 84, None),
    "tiny-glm4v-moe": ("glm4v_moe", 84, None),
    "tiny-mistral3": ("mistral3", 56, None),
    "tiny-gemma4": ("gemma4", 64, None),
    # vis-linear
    "tiny-lfm2-vl": ("lfm2_vl", 64, None),
    "tiny-qwen3-5": ("qwen3_5", 96, None),
    "tiny-qwen3-5-moe": ("qwen3_5_moe", 96, None),
    "tiny-nemotron-omni": ("nemotron_h_nano_omni", 64, "batched output differs from solo"),
    "tiny-kimi-k3": ("kimi_k3", 56, None),
    # vis-b
    "tiny-molmo2": ("molmo2", 378, None),
    "tiny-molmo": ("molmo", 56, None),
    "tiny-qwen3-omni": ("qwen3_omni_moe", 96, None),
    "tiny-moondream3": ("moondream3", 378, None),
    "tiny-step3p7": ("step3p7", 728, None),
    "tiny-muse-glimmer": ("muse_glimmer", 64, None),
    # Issue 41's second pass (tiny_vlm_configs_a.py).
    "tiny-cohere-compass": ("cohere_compass", 56, None),
    "tiny-granite4-vision": ("granite4_vision", 32, None),
    "tiny-mage-vl": ("mage_vl", 56, None),
    "tiny-gemma4-unified": ("gemma4_unified", 64, None),
    "tiny-ernie4-5-vl": ("ernie4_5_moe_vl", 56, None),
    "tiny-mimo-v2": ("mimo_v2", 56, None),
    # Issue 41: more embedding rows than the processor's image tokens (vis-rows).
    "tiny-llava-next": ("llava_next", 28, None),
    "tiny-granite-vision": ("granite_vision", 28, None),
    # Issue 41: an image is mlx-vlm's placeholder id -200, spliced into (side / 64)^2
    # rows (vis41).
    "tiny-fastvlm": ("fastvlm", 128, None),
    # The same placeholder, written by mlx-vlm's generate around a bare tokenizer: 729
    # rows (its image processor's fixed 384 pixels, whatever the side here).
    "tiny-llava-bunny": ("llava_bunny", 384, None),
    # Issue 41: its processor on transformers' PIL backend (no torch); each image's rows
    # its own NaFlex patch grid, at most (96 / 16)^2 (tiny_vlm_configs_notorch.py).
    "tiny-phi4-siglip": ("phi4_siglip", 96, None),
}
# Families whose language model keeps linear-attention / convolution / SSM states
# (ArraysCache), with the KV bytes a token adds to their attention layers (float32):
# layers x (K, V) x KV heads x head_dim x 4, or an MLA layer's latent (16 + 8) x 4.
_KV = 2 * 2 * 16 * 4
LINEAR = {
    "tiny-lfm2-vl": 2 * _KV,
    "tiny-qwen3-5": _KV,
    "tiny-qwen3-5-moe": _KV,
    "tiny-nemotron-omni": _KV,
    "tiny-kimi-k3": (16 + 8) * 4,
}
MAX_TOKENS = 10
# Long enough that gemma3's 16-token sliding window rotates during the prompt.
TEXT = "describe the colours and the shapes you see in this picture, please"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.fixtures.servers import live_server

    root = tmp_path_factory.mktemp("tiny-vlm-families")
    for seed, (name, (family, side, _)) in enumerate(MODELS.items()):
        build_tiny_vlm(root / name, family, seed=seed, image_size=side)
    with live_server(
        tmp_path_factory.mktemp("base"),
        root,
        scheduler={"max_concurrent_requests": 8, "prefill_step_size": 64},
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


_REFERENCE: dict[tuple[str, int, str, tuple[int, int]], list[bytes]] = {}


def answer(
    client: openai.OpenAI, model: str, messages: list[dict], stream: bool = False
) -> list[bytes]:
    """The server's greedy answer, token by token (each token's bytes: token
    for token, whatever the text of a token that is part of a character)."""
    kwargs: dict = {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}
    reply = client.chat.completions.create(model=model, messages=messages, stream=stream, **kwargs)
    if not stream:
        return [bytes(t.bytes) for t in reply.choices[0].logprobs.content]
    chunks = [c.choices[0] for c in reply if c.choices and c.choices[0].logprobs]
    return [bytes(t.bytes) for c in chunks for t in c.logprobs.content]


def mlx_vlm_answer(
    server: Server,
    model: str,
    seed: int,
    tmp: Path,
    text: str = TEXT,
    size: tuple[int, int] = (40, 50),
) -> list[bytes]:
    """mlx-vlm's own greedy generate on the prompt the server builds (its chat
    template, the image after the text), the image read from a file."""
    key = (model, seed, text, size)
    if key not in _REFERENCE:
        from mlx_vlm import load, stream_generate

        folder = next(i.path for i in server.pool.available().values() if i.name == model)
        image = tmp / f"{seed}.png"
        image.write_bytes(png(seed, size))
        vlm, processor = load(str(folder))
        # The processor omlx serves, where mlx-vlm's needs torch (phi4_siglip's).
        processor = served_processor(MODELS[model][0], folder, processor)
        marker = FAMILIES[MODELS[model][0]].image_text
        marker = processor.image_token if marker is None else marker
        prompt = f"<|im_start|>user\n{text}{marker}<|im_end|>\n<|im_start|>assistant\n"
        pieces = stream_generate(
            vlm, processor, prompt, image=[str(image)], max_tokens=MAX_TOKENS, temperature=0.0
        )
        # One result per token; the last (with a finish reason) repeats one.
        tokens = [p.token for p in pieces if p.finish_reason is None]
        # A bare tokenizer where mlx-vlm's processor is one (llava_bunny).
        spell = TokenText(getattr(processor, "tokenizer", processor))
        _REFERENCE[key] = [spell.piece(t)[1] for t in tokens]
    return _REFERENCE[key]


@pytest.mark.parametrize("model", MODELS)
def test_alone_and_streamed_answers_match_mlx_vlm(
    client: openai.OpenAI, server: Server, model: str, tmp_path: Path
) -> None:
    expected = mlx_vlm_answer(server, model, 1, tmp_path)
    assert len(expected) == MAX_TOKENS
    assert answer(client, model, ask(png(1), text=TEXT)) == expected
    assert answer(client, model, ask(png(1), text=TEXT), stream=True) == expected


@pytest.mark.parametrize("model", MODELS)
def test_four_image_requests_at_once_equal_each_alone(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    conversations = [ask(png(30 + i), text=TEXT) for i in range(4)]
    alone = [answer(client, model, m) for m in conversations]
    with ThreadPoolExecutor(len(conversations)) as pool:
        together = list(pool.map(lambda m: answer(client, model, m), conversations))
    assert together == alone
    assert len({b"".join(a) for a in alone}) > 1  # the images make the difference
    engine = next(e for e in server.pool.loaded() if e.name == model)
    reason = MODELS[model][2]
    batching = engine_status(engine)["batching"]
    assert batching["one_at_a_time"] == (reason is not None)
    if reason is not None:
        assert reason in batching["reason"]


@pytest.mark.parametrize("model", MODELS)
def test_a_repeated_image_prompt_is_a_cache_hit_that_matches_mlx_vlm(
    client: openai.OpenAI, server: Server, model: str, tmp_path: Path
) -> None:
    seed = 50 + list(MODELS).index(model)
    expected = mlx_vlm_answer(server, model, seed, tmp_path)
    first = chat(client, model, ask(png(seed), text=TEXT), MAX_TOKENS)
    again = chat(client, model, ask(png(seed), text=TEXT), MAX_TOKENS)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    if FAMILIES[MODELS[model][0]].no_prefix_cache:
        assert cached == 0  # its prompts' KV is never reused (vlm_families.py says why)
    else:
        assert 0 < cached < again.usage.prompt_tokens
    assert answer(client, model, ask(png(seed), text=TEXT)) == expected
    assert first.choices[0].message.content == again.choices[0].message.content


@pytest.mark.parametrize(
    "model",
    [
        "tiny-gemma3",
        "tiny-gemma4",
        "tiny-qwen3-vl",
        "tiny-glm4v",
        "tiny-cohere-compass",
        "tiny-granite4-vision",
        "tiny-ernie4-5-vl",
        "tiny-llava-next",
        "tiny-granite-vision",
        "tiny-fastvlm",
        "tiny-llava-bunny",
        "tiny-phi4-siglip",
        *LINEAR,
    ],
)
def test_an_image_cut_by_prefill_chunks_matches_mlx_vlm(
    client: openai.OpenAI, server: Server, model: str, tmp_path: Path
) -> None:
    # ~60 text tokens, then the image: the 64-token chunks cut its tokens (qwen3_vl's,
    # cohere_compass's and granite4_vision's deepstack features and positions, ERNIE's
    # positions, gemma4's per-layer inputs, are sliced per chunk; gemma3's window wraps;
    # linear-attention states carry over chunks).
    text = "tell me about the colours and the shapes " * 6
    size = (300, 300)
    expected = mlx_vlm_answer(server, model, 60, tmp_path, text, size)
    got = chat(client, model, ask(png(60, size), text=text), MAX_TOKENS)
    assert got.usage.prompt_tokens > 64
    assert answer(client, model, ask(png(60, size), text=text)) == expected


@pytest.mark.parametrize("model", [m for m in MODELS if FAMILIES[MODELS[m][0]].max_images != 1])
def test_two_images_and_text_alone_answer(client: openai.OpenAI, model: str) -> None:
    two = chat(client, model, ask(png(70), png(71), text="compare them"), MAX_TOKENS)
    one = chat(client, model, ask(png(70), text="compare them"), MAX_TOKENS)
    text_only = chat(client, model, [{"role": "user", "content": "compare them"}], MAX_TOKENS)
    assert two.usage.prompt_tokens > one.usage.prompt_tokens > text_only.usage.prompt_tokens
    for reply in (two, one, text_only):
        assert reply.choices[0].finish_reason in ("length", "stop")


def test_mllama_image_of_one_tile_matches_mlx_vlm(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # A square image fills one of the 4 tiles: the prompt's masks keep the others
    # out, the last prompt token's row too (decode steps go without, as mlx-vlm's).
    expected = mlx_vlm_answer(server, "tiny-mllama", 87, tmp_path, size=(28, 28))
    assert answer(client, "tiny-mllama", ask(png(87, (28, 28)), text=TEXT)) == expected
    engine = next(e for e in server.pool.loaded() if e.name == "tiny-mllama")
    assert engine.loaded.vision.dims.tiled_cross_attention  # the image gate prices its states


def test_phi4_siglip_images_of_two_aspects_take_their_own_rows_as_in_mlx_vlm(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # SigLIP2 NaFlex: each image is resized to its own patch grid (its aspect kept, at
    # most 36 patches here) and padded to 36; the model splices each image's unpadded
    # patches at its -200. The prompt omlx prefills counts each image's own rows, and
    # the answer is mlx-vlm's generate's with the same processor.
    from mlx_vlm import load, stream_generate
    from mlx_vlm.utils import prepare_inputs

    folder = next(i.path for i in server.pool.available().values() if i.name == "tiny-phi4-siglip")
    vlm, loaded = load(str(folder))
    processor = served_processor("phi4_siglip", folder, loaded)
    sizes = [(40, 50), (300, 40)]
    images = [str(tmp_path / f"{i}.png") for i in range(len(sizes))]
    for i, (path, size) in enumerate(zip(images, sizes, strict=True)):
        Path(path).write_bytes(png(90 + i, size))
    prompt = f"<|im_start|>user\n{TEXT}<image><image><|im_end|>\n<|im_start|>assistant\n"
    out = prepare_inputs(processor, images=images, prompts=prompt)
    grids = {int(h) * int(w) for h, w in out["spatial_shapes"].tolist()}
    assert len(grids) == 2  # the premise: the two images take different numbers of rows
    extras = {k: out[k] for k in ("spatial_shapes", "pixel_attention_mask")}
    embedded = vlm.get_input_embeddings(out["input_ids"], out["pixel_values"], **extras)
    rows = embedded.inputs_embeds.shape[1]
    pieces = stream_generate(
        vlm, processor, prompt, image=images, max_tokens=MAX_TOKENS, temperature=0.0
    )
    spell = TokenText(processor.tokenizer)
    expected = [spell.piece(p.token)[1] for p in pieces if p.finish_reason is None]
    conversation = ask(*(png(90 + i, size) for i, size in enumerate(sizes)), text=TEXT)
    reply = chat(client, "tiny-phi4-siglip", conversation, MAX_TOKENS)
    assert reply.usage.prompt_tokens == rows
    assert answer(client, "tiny-phi4-siglip", conversation) == expected


@pytest.mark.parametrize("model", ["tiny-phi4-siglip", "tiny-fastvlm"])
def test_an_image_marker_written_in_the_text_is_a_clear_400(
    client: openai.OpenAI, model: str
) -> None:
    # Each "<image>" of the text becomes a placeholder id an image: one the text writes
    # itself would have no image to fill it.
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, ask(png(74), text=f"what is <image> here? {TEXT}"), MAX_TOKENS)
    message = info.value.response.json()["error"]["message"]
    assert "2 image placeholders for 1 image" in message and "'<image>'" in message


@pytest.mark.parametrize("model", [m for m in MODELS if FAMILIES[MODELS[m][0]].max_images == 1])
def test_a_one_image_family_takes_one_image_a_request_and_says_so(
    client: openai.OpenAI, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, ask(png(72), png(73)), MAX_TOKENS)
    error = info.value.response.json()["error"]
    assert error["param"] == "messages[0].content[2]"
    assert "at most 1 image" in error["message"] and MODELS[model][0] in error["message"]
    text_only = chat(client, model, [{"role": "user", "content": "hi"}], MAX_TOKENS)
    assert text_only.choices[0].finish_reason in ("length", "stop")


def _vision_model_types() -> set[str]:
    """mlx-vlm's model packages with a vision tower (text-only decoders it carries
    for its VLMs, such as ministral3, have none): what a user may load as a VLM."""
    import mlx_vlm.models

    found = set()
    for package in Path(mlx_vlm.models.__file__).parent.iterdir():
        sources = [f.read_text(encoding="utf-8") for f in package.glob("*.py")]
        if any("vision_config" in s or "class VisionModel" in s for s in sources):
            found.add(package.name)
    return found


def test_every_mlx_vlm_vision_family_is_served_or_refused_with_a_reason() -> None:
    # A new mlx-vlm with another family fails here until the family is tried: served
    # (FAMILIES, checked above) or refused with the reason (REFUSED).
    assert not set(FAMILIES) & set(REFUSED)
    assert _vision_model_types() == set(FAMILIES) | set(REFUSED)


def test_a_checkpoints_model_type_of_another_name_finds_its_family() -> None:
    # Published checkpoints carry the model types mlx-vlm remaps (FastVLM's llava_qwen2,
    # Bunny's bunny-llama, LFM2-VL's lfm2-vl): each finds the family mlx-vlm loads.
    from mlx_vlm.utils import MODEL_REMAPPING

    vision = set(FAMILIES) | set(REFUSED)
    remapped = {k: v for k, v in MODEL_REMAPPING.items() if v in vision and k != v}
    assert remapped == ALIASES
    assert family_of("llava_qwen2") is FAMILIES["fastvlm"]
    assert family_of("bunny-llama") is FAMILIES["llava_bunny"]


@pytest.mark.parametrize("model_type", [*sorted(REFUSED), "moondream1"])
def test_a_refused_family_is_a_load_error_naming_it_and_why(
    model_type: str, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    info = ModelInfo("some-vlm", tmp_path, model_type, "vlm", 1)
    with pytest.raises(ModelLoadError) as error:
        load_vlm(info)
    message = str(error.value)
    assert "'some-vlm'" in message and f"'{model_type}'" in message
    assert REFUSED[ALIASES.get(model_type, model_type)] in message and "qwen3_vl" in message


@pytest.mark.parametrize("model", LINEAR)
def test_the_guard_of_a_linear_attention_vlm_prices_its_attention_layers_measured(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    # As for text hybrids (tests/integration/test_kv_measure.py): the states are
    # fixed per sequence, so only the attention layers grow per token, read from
    # the model's own cache rather than the config's every-layer figure.
    chat(client, model, ask(png(1), text=TEXT), 1)
    engine = next(e for e in server.pool.loaded() if e.name == model)
    dims = engine.guard.dims
    every_layer = dims.num_layers * 2 * dims.num_kv_heads * dims.head_dim * dims.kv_dtype_bytes
    assert dims.kv_bytes_per_token == LINEAR[model] < every_layer
    assert "B/token (measured)" in engine.guard.describe()


@pytest.mark.parametrize("model", ["tiny-llava-next", "tiny-fastvlm", "tiny-llava-bunny"])
def test_a_prompt_counts_the_rows_its_model_embeds_where_they_outnumber_its_tokens(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    # mlx-vlm's llava_next splices a block of patches a tile, then a newline block a
    # tile: more rows than its processor writes image tokens; fastvlm's processor writes
    # one id (-200) an image, which its model replaces by the image's cells. The prompt
    # omlx prefills (usage, the context window, the guard's price, the prefix cache)
    # counts the rows.
    import io

    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    folder = next(i.path for i in server.pool.available().values() if i.name == model)
    vlm, processor = load(str(folder))
    prompt = f"<|im_start|>user\n{TEXT}<image><|im_end|>\n<|im_start|>assistant\n"
    image = Image.open(io.BytesIO(png(80))).convert("RGB")
    # The inputs mlx-vlm's generate builds (its prompt ids, with -200 where it writes one).
    index = getattr(vlm.config, "image_token_index", None)
    out = prepare_inputs(processor, images=[image], prompts=prompt, image_token_index=index)
    ids = out["input_ids"]
    rows = vlm.get_input_embeddings(ids, out["pixel_values"]).inputs_embeds.shape[1]
    assert rows > ids.shape[1]
    reply = chat(client, model, ask(png(80), text=TEXT), MAX_TOKENS)
    assert reply.usage.prompt_tokens == rows
