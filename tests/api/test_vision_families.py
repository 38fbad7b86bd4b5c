"""More mlx-vlm families (issue 41, defect 6), each a tiny random model served by a
live server and checked against mlx-vlm's own ``stream_generate`` (greedy) on the
same image and prompt: alone, streamed, four image requests at once, and a repeated
image prompt served from the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import openai
import pytest

from omlx.api.server import Server
from omlx.cache.prefix import CacheHit
from omlx.engine.engine_status import engine_status
from omlx.engine.image_prefill import usable_hit
from omlx.engine.token_text import TokenText
from omlx.errors import ModelLoadError
from omlx.models.discovery import ModelInfo
from omlx.models.vlm import load_vlm
from omlx.models.vlm_families import ALIASES, FAMILIES, GEMMA4_BIDIRECTIONAL, Family
from omlx.models.vlm_families import family as family_of
from omlx.models.vlm_processors import served_processor
from omlx.models.vlm_refusals import REFUSED
from tests.api.test_vision import ask, chat, png
from tests.fixtures.tiny_vlm_configs_a import shallow_fastvlm_tower
from tests.fixtures.tiny_vlm_configs_gemma3n import shallow_gemma3n_tower
from tests.fixtures.tiny_vlm_configs_llama4 import ATTENTION_CHUNK
from tests.fixtures.tiny_vlm_configs_phi import shallow_phi3_v_tower
from tests.fixtures.tiny_vlm_configs_vfam1 import STARMIE_REPO, cache_starmie, offline_hub
from tests.fixtures.tiny_vlms import build_tiny_vlm

# model name -> (family, the processor's image side, why it runs one at a time or None)
MODELS: dict[str, tuple[str, int, str | None]] = {
    "tiny-gemma3": ("gemma3", 56, None),
    "tiny-idefics3": ("idefics3", 56, None),
    "tiny-smolvlm": ("smolvlm", 56, None),
    "tiny-qwen3-vl": ("qwen3_vl", 96, None),
    "tiny-paligemma": ("paligemma", 28, "bidirectional"),
    "tiny-mllama": ("mllama", 28, None),
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
    # moondream3's processor and layout over a phi-style decoder (vfam1); its tokenizer
    # from a Hub cache of the module's own (tiny_vlm_configs_vfam1.cache_starmie).
    "tiny-moondream2": ("moondream2", 378, None),
    # Issue 41's untried families (vfam3): the image processor's own 378-pixel crops.
    "tiny-jina-vlm": ("jina_vlm", 378, "longest row's offset"),
    # Gemma 4 as its larger checkpoints are (26B A4B, 31B): an image's tokens attend
    # each other both ways (GEMMA4_BIDIRECTIONAL).
    "tiny-gemma4-bidirectional": ("gemma4_bidirectional", 64, None),
    # Issue 41: its processor on transformers' PIL backend (no torch); each image's rows
    # its own NaFlex patch grid, at most (96 / 16)^2 (tiny_vlm_configs_notorch.py).
    "tiny-phi4-siglip": ("phi4_siglip", 96, None),
    # Llama 4: chunked attention (ChunkedKVCache, which mlx-lm cannot batch) over 32
    # tokens, fewer than every image prompt here has (tiny_vlm_configs_llama4.py).
    "tiny-llama4": ("llama4", 56, "does not yet support batching"),
    # Issue 41: its last layers read their source layers' KV (models/vlm_caches.py SharedKV),
    # one request at a time (vlm_families.py says why);
    # 256-pixel images: its MobileNetV5 tower's fixed 16 x 16 output grid, unresampled.
    "tiny-gemma3n": ("gemma3n", 256, "by the forward's length"),
    # Issue 41: a list of slice arrays a prompt, each its own size (112-pixel slices:
    # 4 tokens each; a 300x300 image is a thumbnail and 3x3 slices).
    "tiny-minicpmv4-6": ("minicpmv4_6", 112, None),
    "tiny-minicpmv4-7": ("minicpmv4_7", 112, None),
    # Each image one array at its own aspect, resampled to 8 rows.
    "tiny-minicpmo": ("minicpmo", 56, None),
    # Issue 41: its processor writes one instruction turn around one user message, the
    # images' tiles (28-pixel tiles of 4 patches, a thumbnail when several) first; a
    # PLaMo 2 decoder of Mamba and attention layers (tiny_vlm_configs_plamo.py).
    "tiny-plamo2vl": ("plamo2vl", 28, None),
    # Issue 41: mlx-vlm's own cache class (MiniMaxM3KVCache on its sparse layer), one
    # request at a time on the model's own cache, no prefix cache
    # (tiny_vlm_configs_owncache.py); 112-pixel images: 16 image tokens.
    "tiny-minimax-m3-vl": ("minimax_m3_vl", 112, "not mlx-lm's"),
    # Qwen3.5's layout with QSA sparse layers on mlx-vlm's QSAKVCache, the same path.
    "tiny-qwen4-exp": ("qwen4_exp", 96, "not mlx-lm's"),
    # Issue 41: the processor writes image n's HD crops as ids -n (tiny_vlm_configs_phi.py:
    # mlx-vlm's fixed CLIP ViT-L/14 tower at 336 pixels, whatever the side here).
    "tiny-phi3-v": ("phi3_v", 336, None),
    # Issue 41: phi4_siglip's -200 and NaFlex patches (at most (56 / 14)^2 an image), the
    # unquantized checkpoint's vision LoRA merged by mlx-vlm's load.
    "tiny-phi4mm": ("phi4mm", 56, None),
    # Issue 41: XD-RoPE positions the model keeps between forwards (vlm_families.py says
    # how omlx gives each forward its own); its processor's own 512-pixel least side.
    "tiny-hunyuan-vl": ("hunyuan_vl", 512, "shared cache index"),
    # Issue 41: mlx-vlm's own CacheList with a PoolingCache (its indexer's pooled keys)
    # and ArraysCache, the own-cache path (tiny_vlm_configs_glm5.py): at most 16 tokens.
    "tiny-glm5-next": ("glm5_next", 112, "not mlx-lm's"),
    # One DeepseekV41Cache for every layer; image spans laid out by its own processor's
    # records (tiny_vlm_configs_deepseek_v41.py): 56-pixel images, 2x2 aligner cells.
    "tiny-deepseek-v41": ("deepseek_v41", 56, "not mlx-lm's"),
    # Issue 41: a CacheList a layer (KV and its short convolutions' states: mlx-lm's
    # classes, batched and cached); the processor's fixed 40-pixel patches, one row each.
    "tiny-inkling": ("inkling", 40, None),
    # Issue 41: DeepSeek-VL / Janus, llava_bunny's prompt around a bare tokenizer (its
    # config's image token) and 576 rows an image (mlx-vlm pads every image to 384 pixels);
    # its module imports cv2, which the tests install (test_vlm_optional_modules.py).
    "tiny-multi-modality": ("multi_modality", 384, None),
    # Issue 41: deepseek_v41 with an Engram layer (tiny_vlm_configs_deepseek_v41.py): its
    # n-gram history on each request's own cache, its hash table read from the file.
    "tiny-deepseek-v41-engram": ("deepseek_v41_engram", 56, "not mlx-lm's"),
}
# Models built with another's seed: tiny-gemma4's weights, only the attention flag
# differs (its images then change the answers: the test below checks it).
SAME_WEIGHTS = {"tiny-gemma4-bidirectional": "tiny-gemma4"}
# Seeds follow MODELS' row order; a row checked on a branch whose table was shorter keeps
# the seed it was checked with (a random tiny model of another seed may answer every
# image alike: tiny-phi4mm at its row's index).
SEEDS = {"tiny-phi4mm": 46, "tiny-deepseek-v41-engram": 58}
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
    "tiny-minicpmv4-6": _KV,
    "tiny-minicpmv4-7": _KV,
    "tiny-plamo2vl": 2 * _KV,
}
MAX_TOKENS = 10


def traits(model: str) -> Family:
    """The entry omlx serves ``model`` by: its family's, or the variant its config
    makes it (tiny_vlms.py builds gemma4_bidirectional as a gemma4 checkpoint,
    deepseek_v41_engram as a deepseek_v41 one)."""
    built = MODELS[model][0]
    if built == "gemma4_bidirectional":
        return GEMMA4_BIDIRECTIONAL
    return FAMILIES[built.removesuffix("_engram")]


# Long enough that gemma3's 16-token sliding window rotates during the prompt.
TEXT = "describe the colours and the shapes you see in this picture, please"
# A text-only turn of its own (other tests send TEXT alone expecting no cache hit).
TEXT_ONLY = "tell me a short story about the colours and the shapes of a garden"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.fixtures.servers import live_server

    root = tmp_path_factory.mktemp("tiny-vlm-families")
    with pytest.MonkeyPatch.context() as patch:
        # mlx-vlm's fixed-size towers, shallow (their docstrings say what stays theirs).
        shallow_phi3_v_tower(patch)
        shallow_gemma3n_tower(patch)
        shallow_fastvlm_tower(patch)
        for name, (family, side, _) in MODELS.items():
            seed = SEEDS.get(name, list(MODELS).index(SAME_WEIGHTS.get(name, name)))
            build_tiny_vlm(root / name, family, seed=seed, image_size=side)
        hub = cache_starmie(tmp_path_factory.mktemp("hub"), root / "tiny-moondream2")
        with (
            offline_hub(hub),
            live_server(
                tmp_path_factory.mktemp("base"),
                root,
                scheduler={"max_concurrent_requests": 8, "prefill_step_size": 64},
            ) as srv,
        ):
            yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


_REFERENCE: dict[tuple[str, int, str, tuple[int, int]], list[bytes]] = {}
_PROCESSORS: dict[Path, Any] = {}


def mlx_vlm_load(server: Server, model: str) -> tuple[Any, Any]:
    """mlx-vlm's load of ``model``'s folder: a fresh model each call, its processor
    loaded once a module (mlx-vlm's phi4_siglip processor takes seconds a load, as
    its from_pretrained recurses through transformers' auto classes)."""
    from mlx_vlm import load
    from mlx_vlm.utils import load_model

    folder = next(i.path for i in server.pool.available().values() if i.name == model)
    if folder not in _PROCESSORS:
        vlm, _PROCESSORS[folder] = load(str(folder))
        return vlm, _PROCESSORS[folder]
    return load_model(folder), _PROCESSORS[folder]


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


@lru_cache(maxsize=1)
def mlx_vlm_answer(
    server: Server,
    model: str,
    seed: int,
    tmp: Path,
    text: str = TEXT,
    size: tuple[int, int] | None = (40, 50),
) -> list[bytes]:
    """mlx-vlm's own greedy generate on the prompt the server builds (its chat
    template, the image after the text), the image read from a file (size None: a
    text-only prompt, no image)."""
    key = (model, seed, text, size)
    if key not in _REFERENCE:
        from mlx_vlm import stream_generate

        folder = next(i.path for i in server.pool.available().values() if i.name == model)
        vlm, processor = mlx_vlm_load(server, model)
        # The processor omlx serves, where mlx-vlm's needs torch (phi4_siglip's).
        processor = served_processor(MODELS[model][0], folder, processor)
        marker = traits(model).image_text
        # The first image's marker, where the family numbers them (phi3_v's "<|image_1|>").
        marker = processor.image_token if marker is None else marker.format(n=1)
        images = None
        if size is not None:
            images = [str(tmp / f"{seed}.png")]
            Path(images[0]).write_bytes(png(seed, size))
        else:
            marker = ""
        prompt = f"<|im_start|>user\n{text}{marker}<|im_end|>\n<|im_start|>assistant\n"
        if traits(model).instruction_turn:
            prompt = text  # the processor writes the turn (mlx-vlm's PROMPT_ONLY)
        pieces = stream_generate(
            vlm, processor, prompt, image=images, max_tokens=MAX_TOKENS, temperature=0.0
        )
        # One result per token; the last (with a finish reason) repeats one.
        tokens = [p.token for p in pieces if p.finish_reason is None]
        # A bare tokenizer where mlx-vlm's processor is one (llava_bunny).
        spell = TokenText(getattr(processor, "tokenizer", processor))
        _REFERENCE[key] = [spell.piece(t)[1] for t in tokens]
    return _REFERENCE[key]


@pytest.mark.parametrize("model", MODELS)
def test_alone_streamed_and_text_only_answers_match_mlx_vlm(
    client: openai.OpenAI, server: Server, model: str, tmp_path: Path
) -> None:
    expected = mlx_vlm_answer(server, model, 1, tmp_path)
    assert len(expected) == MAX_TOKENS
    # Users send text turns to a VLM: mlx-vlm's generate embeds them by its model's
    # get_input_embeddings without pixels (gemma3n's rows unscaled there, where its
    # language model scales ids: RunnerLayout.embedded_prompts), before and after an
    # image prompt; paligemma's in one forward, as mlx-vlm's model declines chunks
    # (Family.whole_text_prompt). A tiny random model may stop early (its EOS): compared
    # as it is. An instruction-turn family takes no text-only prompt (its 400: below).
    checks_text = not traits(model).instruction_turn
    text = [{"role": "user", "content": TEXT_ONLY}]
    if checks_text:
        text_only = mlx_vlm_answer(server, model, 0, tmp_path, TEXT_ONLY, size=None)
        assert answer(client, model, text) == text_only
    assert answer(client, model, ask(png(1), text=TEXT)) == expected
    assert answer(client, model, ask(png(1), text=TEXT), stream=True) == expected
    if checks_text:
        assert answer(client, model, text) == text_only


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
    if traits(model).no_prefix_cache:
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
        "tiny-jina-vlm",
        "tiny-gemma4-bidirectional",
        "tiny-phi4-siglip",
        "tiny-llama4",
        "tiny-gemma3n",
        "tiny-minicpmo",
        "tiny-minimax-m3-vl",
        "tiny-qwen4-exp",
        "tiny-phi3-v",
        "tiny-phi4mm",
        "tiny-hunyuan-vl",
        "tiny-glm5-next",
        "tiny-deepseek-v41",
        "tiny-deepseek-v41-engram",
        "tiny-inkling",
        "tiny-multi-modality",
        *LINEAR,
    ],
)
def test_an_image_cut_by_prefill_chunks_matches_mlx_vlm(
    client: openai.OpenAI, server: Server, model: str, tmp_path: Path
) -> None:
    # ~60 text tokens, then the image: the 64-token chunks cut its tokens (qwen3_vl's,
    # cohere_compass's and granite4_vision's deepstack features and positions, ERNIE's
    # positions, gemma4's per-layer inputs, are sliced per chunk; gemma3's window wraps;
    # linear-attention states carry over chunks; bidirectional gemma4's prompt goes in
    # one forward, as mlx-vlm's generate gives it; llama4's chunked layers drop the keys
    # of each attention chunk the prompt passes).
    text = "tell me about the colours and the shapes " * 6
    size = (300, 300)
    expected = mlx_vlm_answer(server, model, 60, tmp_path, text, size)
    got = chat(client, model, ask(png(60, size), text=text), MAX_TOKENS)
    assert got.usage.prompt_tokens > 64 >= 2 * ATTENTION_CHUNK
    assert answer(client, model, ask(png(60, size), text=text)) == expected


def test_an_engram_n_gram_across_a_prefill_chunk_boundary_matches_mlx_vlm(
    client: openai.OpenAI, server: Server
) -> None:
    # deepseek_v41's Engram hashes each token with the 3 before it, from the token
    # history its cache keeps: in a text prompt whose last 64-token chunk (the server's
    # prefill_step_size) holds only its last 1 to 3 tokens, their n-grams reach into the
    # chunk before, as in mlx-vlm's one-forward prefill.
    model = "tiny-deepseek-v41-engram"
    tokenizer = mlx_vlm_load(server, model)[1].tokenizer
    words = ("colours", "shapes", "of", "the", "garden", "a")
    for n in range(200):
        text = " ".join(words[i % len(words)] for i in range(n))
        prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        if 65 < len(tokenizer.encode(prompt)) <= 67:
            break
    expected = _mlx_vlm_text_answer(server, model, text)
    messages = [{"role": "user", "content": text}]
    assert 65 < chat(client, model, messages, MAX_TOKENS).usage.prompt_tokens <= 67
    assert len(expected) == MAX_TOKENS
    assert answer(client, model, messages) == expected


def test_a_loaded_engram_model_is_priced_without_the_tables_it_reads_from_its_files(
    client: openai.OpenAI, server: Server
) -> None:
    # mlx-vlm maps deepseek_v41's Engram hash tables from the safetensors and reads the
    # rows a forward looks up (a real checkpoint's: ~384M rows a layer): the pool prices
    # the weights the model holds, every other tensor of its file, before its load
    # (the fit check's figure) and after.
    import mlx.core as mx

    model = "tiny-deepseek-v41-engram"
    answer(client, model, [{"role": "user", "content": TEXT_ONLY}])
    engine = next(e for e in server.pool.loaded() if e.name == model)
    tensors = mx.load(str(engine.loaded.info.path / "model.safetensors"))
    table = tensors.pop("language_model.layers.1.engram.embed.weight")
    assert table.nbytes > 0
    held = sum(t.nbytes for t in tensors.values())
    assert engine.loaded.weights_bytes() == held
    info = server.pool.available()[model]
    file_bytes = (info.path / "model.safetensors").stat().st_size
    assert info.size_bytes == file_bytes - table.nbytes


def _mlx_vlm_text_answer(server: Server, model: str, text: str) -> list[bytes]:
    """mlx-vlm's own greedy generate on a text-only prompt, on a freshly loaded model."""
    from mlx_vlm import load, stream_generate

    folder = next(i.path for i in server.pool.available().values() if i.name == model)
    vlm, processor = load(str(folder))
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    pieces = stream_generate(vlm, processor, prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    spell = TokenText(processor.tokenizer)
    return [spell.piece(p.token)[1] for p in pieces if p.finish_reason is None]


def test_hunyuan_vl_prompts_after_an_image_prompt_answer_as_on_a_fresh_model(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # mlx-vlm's language model keeps an image prompt's XD-RoPE positions for its next
    # forward from the cache's start: a text prompt after an image prompt (then a
    # longer one), and another image prompt after those, each answer as mlx-vlm's
    # generate does on a fresh model. Images no other test sends: no prefix-cache hit
    # spares an image prompt its embedding (which sets the positions the model keeps).
    model = "tiny-hunyuan-vl"
    short, longer = TEXT, f"{TEXT} and tell me more about them"
    expected = {
        "image": mlx_vlm_answer(server, model, 80, tmp_path),
        "text": _mlx_vlm_text_answer(server, model, short),
        "longer text": _mlx_vlm_text_answer(server, model, longer),
        "other image": mlx_vlm_answer(server, model, 81, tmp_path),
    }
    conversations = {
        "image": ask(png(80), text=TEXT),
        "text": [{"role": "user", "content": short}],
        "longer text": [{"role": "user", "content": longer}],
        "other image": ask(png(81), text=TEXT),
    }
    for name, messages in conversations.items():
        assert len(expected[name]) == MAX_TOKENS
        assert answer(client, model, messages) == expected[name], name
    assert expected["text"] != expected["image"] != expected["other image"]


@pytest.mark.parametrize(
    "model",
    # A text-only chat with an instruction-turn family is a 400 (tested below).
    [m for m in MODELS if traits(m).max_images != 1 and not traits(m).instruction_turn],
)
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


def _mllama_reference(server: Server, images: list[Path], text: str) -> list[tuple[bytes, float]]:
    """mlx-vlm's own greedy generate on the prompt the server builds for tiny-mllama
    (each image's marker after the text; none: a text-only prompt), each token with
    its logprob."""
    from mlx_vlm import stream_generate

    vlm, processor = mlx_vlm_load(server, "tiny-mllama")
    markers = processor.image_token * len(images)
    prompt = f"<|im_start|>user\n{text}{markers}<|im_end|>\n<|im_start|>assistant\n"
    pieces = stream_generate(
        vlm,
        processor,
        prompt,
        image=[str(i) for i in images] or None,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    spell = TokenText(processor.tokenizer)
    return [
        (spell.piece(p.token)[1], float(p.logprobs[p.token]))
        for p in pieces
        if p.finish_reason is None
    ]


def _scored(client: openai.OpenAI, messages: list[dict]) -> list[tuple[bytes, float]]:
    kwargs: dict = {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}
    reply = client.chat.completions.create(model="tiny-mllama", messages=messages, **kwargs)
    return [(bytes(t.bytes), t.logprob) for t in reply.choices[0].logprobs.content]


def _same(got: list[tuple[bytes, float]], expected: list[tuple[bytes, float]]) -> bool:
    return [t for t, _ in got] == [t for t, _ in expected] and all(
        abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(got, expected, strict=True)
    )


def test_mllama_rows_with_other_images_or_none_share_the_decode_batch(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # One tile, four tiles (of the processor's 4: the same number of states, other
    # masks at prefill), two images (twice the states: the batch pads the others'
    # and masks them out), and no image (the cross layers' text-only path).
    sizes = {"one tile": [(28, 28)], "four tiles": [(40, 50)], "two images": [(28, 28), (40, 50)]}
    conversations: dict[str, list[dict]] = {}
    expected: dict[str, list[tuple[bytes, float]]] = {}
    for e, (name, shapes) in enumerate(sizes.items()):
        files = []
        for i, size in enumerate(shapes):
            files.append(tmp_path / f"{e}-{i}.png")
            files[-1].write_bytes(png(100 + e + i, size))
        conversations[name] = ask(*(f.read_bytes() for f in files), text=TEXT)
        expected[name] = _mllama_reference(server, files, TEXT)
    conversations["text only"] = [{"role": "user", "content": TEXT}]
    expected["text only"] = _mllama_reference(server, [], TEXT)
    alone = {name: _scored(client, m) for name, m in conversations.items()}
    with ThreadPoolExecutor(len(conversations)) as pool:
        replies = list(pool.map(partial(_scored, client), conversations.values()))
    together = dict(zip(conversations, replies, strict=True))
    for name in conversations:
        assert len(expected[name]) == MAX_TOKENS
        assert _same(alone[name], expected[name]), name
        assert _same(together[name], alone[name]), name
    assert len({tuple(t for t, _ in a) for a in alone.values()}) > 1  # the images matter
    engine = next(e for e in server.pool.loaded() if e.name == "tiny-mllama")
    assert engine_status(engine)["batching"]["one_at_a_time"] is False


def test_phi4_siglip_images_of_two_aspects_take_their_own_rows_as_in_mlx_vlm(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # SigLIP2 NaFlex: each image is resized to its own patch grid (its aspect kept, at
    # most 36 patches here) and padded to 36; the model splices each image's unpadded
    # patches at its -200. The prompt omlx prefills counts each image's own rows, and
    # the answer is mlx-vlm's generate's with the same processor.
    from mlx_vlm import stream_generate
    from mlx_vlm.utils import prepare_inputs

    folder = next(i.path for i in server.pool.available().values() if i.name == "tiny-phi4-siglip")
    vlm, loaded = mlx_vlm_load(server, "tiny-phi4-siglip")
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


def test_phi3_v_images_of_two_aspects_take_their_own_crops_as_in_mlx_vlm(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # The HD transform gives a squarish image one crop (313 rows) and a wide one two
    # (457): the processor writes each image's rows as ids -1 and -2 and pads the
    # first image's crops to the second's. The prompt omlx prefills counts each
    # image's own rows, and the answer is mlx-vlm's generate's on the same prompt.
    from mlx_vlm import load, stream_generate
    from mlx_vlm.utils import prepare_inputs

    folder = next(i.path for i in server.pool.available().values() if i.name == "tiny-phi3-v")
    vlm, processor = load(str(folder))
    sizes = [(40, 50), (40, 300)]
    images = [str(tmp_path / f"{i}.png") for i in range(len(sizes))]
    for i, (path, size) in enumerate(zip(images, sizes, strict=True)):
        Path(path).write_bytes(png(92 + i, size))
    marks = "<|image_1|><|image_2|>"
    prompt = f"<|im_start|>user\n{TEXT}{marks}<|im_end|>\n<|im_start|>assistant\n"
    ids = prepare_inputs(processor, images=images, prompts=prompt)["input_ids"][0].tolist()
    rows = [ids.count(-1), ids.count(-2)]
    assert rows == [313, 457]  # the premise: the images take different numbers of rows
    pieces = stream_generate(
        vlm, processor, prompt, image=images, max_tokens=MAX_TOKENS, temperature=0.0
    )
    spell = TokenText(processor.tokenizer)
    expected = [spell.piece(p.token)[1] for p in pieces if p.finish_reason is None]
    conversation = ask(*(png(92 + i, size) for i, size in enumerate(sizes)), text=TEXT)
    reply = chat(client, "tiny-phi3-v", conversation, MAX_TOKENS)
    assert reply.usage.prompt_tokens == len(ids)
    assert answer(client, "tiny-phi3-v", conversation) == expected


def test_a_phi3_v_image_marker_written_in_the_text_is_a_clear_400(client: openai.OpenAI) -> None:
    # Its processor takes every "<|image_n|>" of the text for an image: one the text
    # writes itself would be an image with no pixels (or a second copy of one).
    for written in ("<|image_1|>", "<|image_2|>"):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, "tiny-phi3-v", ask(png(74), text=f"what is {written}? {TEXT}"), 1)
        message = info.value.response.json()["error"]["message"]
        assert f"writes the image marker '{written}' itself" in message


def test_phi4mm_answers_text_and_images_under_the_vision_lora_as_mlx_vlm(
    client: openai.OpenAI, server: Server
) -> None:
    # Unquantized, mlx-vlm's load merges the vision LoRA into the decoder's weights, and
    # its generate keeps them so for a text-only prompt too (it switches the LoRA only
    # for images or audio): one weights state, which the batch and the prefix cache
    # share. After an image request, a text request answers as mlx-vlm's generate, and
    # again as a prefix-cache hit. The premise: without the LoRA it would answer otherwise.
    from mlx_vlm import load, stream_generate

    folder = next(i.path for i in server.pool.available().values() if i.name == "tiny-phi4mm")
    vlm, processor = load(str(folder))
    assert vlm._base_weights and vlm._active_lora == "vision"  # a LoRA, merged
    text = f"{TEXT}, once more"
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    spell = TokenText(processor.tokenizer)

    def generate() -> list[bytes]:
        pieces = stream_generate(vlm, processor, prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        return [spell.piece(p.token)[1] for p in pieces if p.finish_reason is None]

    expected = generate()
    assert vlm._active_lora == "vision"  # a text-only prompt keeps it
    vlm.apply_base_weights()
    assert generate() != expected
    answer(client, "tiny-phi4mm", ask(png(95), text=TEXT))
    for cached in (False, True):
        reply = client.chat.completions.create(
            model="tiny-phi4mm",
            messages=[{"role": "user", "content": text}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
        )
        assert (reply.usage.prompt_tokens_details.cached_tokens > 0) == cached
        assert [bytes(t.bytes) for t in reply.choices[0].logprobs.content] == expected


@pytest.mark.parametrize("model", ["tiny-phi4-siglip", "tiny-fastvlm", "tiny-phi4mm"])
def test_an_image_marker_written_in_the_text_is_a_clear_400(
    client: openai.OpenAI, model: str
) -> None:
    # Each "<image>" of the text becomes a placeholder id an image: one the text writes
    # itself would have no image to fill it.
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, ask(png(74), text=f"what is <image> here? {TEXT}"), MAX_TOKENS)
    message = info.value.response.json()["error"]["message"]
    assert "2 image placeholders for 1 image" in message and "'<image>'" in message


@pytest.mark.parametrize("model", [m for m in MODELS if traits(m).max_images == 1])
def test_a_one_image_family_takes_one_image_a_request_and_says_so(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, ask(png(72), png(73)), MAX_TOKENS)
    error = info.value.response.json()["error"]
    assert error["param"] == "messages[0].content[2]"
    # The model type its config says (jina_vlm's checkpoints say "jvlm").
    model_type = next(i.model_type for i in server.pool.available().values() if i.name == model)
    assert "at most 1 image" in error["message"] and f"({model_type})" in error["message"]
    text_only = chat(client, model, [{"role": "user", "content": "hi"}], MAX_TOKENS)
    assert text_only.choices[0].finish_reason in ("length", "stop")


def test_gemma4_is_served_by_what_its_text_config_says_of_image_attention(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # Gemma 4 26B A4B and 31B say use_bidirectional_attention "vision", E2B and E4B
    # nothing: each is served by the entry for its attention (checked against mlx-vlm
    # above), and text prompts of the bidirectional one keep the prefix cache.
    # The premise: on the same weights, the flag changes mlx-vlm's answer.
    assert SAME_WEIGHTS["tiny-gemma4-bidirectional"] == "tiny-gemma4"
    causal = mlx_vlm_answer(server, "tiny-gemma4", 1, tmp_path)
    assert mlx_vlm_answer(server, "tiny-gemma4-bidirectional", 1, tmp_path) != causal
    text = [{"role": "user", "content": TEXT}]
    for model, entry in (
        ("tiny-gemma4", FAMILIES["gemma4"]),
        ("tiny-gemma4-bidirectional", GEMMA4_BIDIRECTIONAL),
    ):
        first = chat(client, model, text, MAX_TOKENS)
        again = chat(client, model, text, MAX_TOKENS)
        engine = next(e for e in server.pool.loaded() if e.name == model)
        assert engine.loaded.vision.family is entry
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
        assert first.choices[0].message.content == again.choices[0].message.content


def test_a_bidirectional_image_prompt_takes_a_cache_hit_only_past_its_images(
    client: openai.OpenAI, server: Server
) -> None:
    # mlx-vlm lays the image block mask over a forward from the first token only: a
    # hit ending before (or inside) an image would leave its tokens attending causally.
    visions = {}
    for model in ("tiny-gemma4-bidirectional", "tiny-gemma4"):
        chat(client, model, [{"role": "user", "content": "hi"}], 1)
        visions[model] = next(e for e in server.pool.loaded() if e.name == model).loaded.vision
    vision = visions["tiny-gemma4-bidirectional"]
    prompt = [5] * 8 + [vision.image_token_id] * 4 + [6] * 8
    for num_tokens in (4, 8, 10):
        assert usable_hit(vision, prompt, CacheHit([], num_tokens)) is None
    past = CacheHit([], 12)
    assert usable_hit(vision, prompt, past) is past
    early = CacheHit([], 4)
    assert usable_hit(visions["tiny-gemma4"], prompt, early) is early


@pytest.mark.parametrize("model", ["tiny-gemma4-bidirectional", "tiny-hunyuan-vl"])
def test_an_image_prompt_embedded_from_its_first_token_whose_hit_ends_before_it_starts_over(
    client: openai.OpenAI,
    server: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
) -> None:
    # Two prompts with the same image part after a block of the same text (the prefix
    # cache's 256 tokens): the second's hit would end before its image, where the
    # image's tokens could only attend causally (bidirectional gemma4) or sit at plain
    # rope positions (hunyuan_vl). It prefills from its first token and answers as
    # mlx-vlm does; asked again, its whole prompt but the last token hits.
    # The memory gate prices each prefill with the cached tokens the runner takes (a
    # dropped hit is a whole prefill), read here through the gate's own count.
    assert traits(model).images_from_first_token
    shared = "tell me about the colours and the shapes " * 40
    chat(client, model, ask(png(90), text=shared + "first"), MAX_TOKENS)
    expected = mlx_vlm_answer(server, model, 90, tmp_path, shared + "second")
    gate = next(e for e in server.pool.loaded() if e.name == model).gate
    counted: list[int] = []
    count = gate._cached_tokens
    monkeypatch.setattr(gate, "_cached_tokens", lambda r: counted.append(count(r)) or counted[-1])
    for cached in (0, None):
        counted.clear()
        reply = client.chat.completions.create(
            model=model,
            messages=ask(png(90), text=shared + "second"),
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
        )
        assert [bytes(t.bytes) for t in reply.choices[0].logprobs.content] == expected
        held = reply.usage.prompt_tokens_details.cached_tokens
        assert held == (reply.usage.prompt_tokens - 1 if cached is None else cached)
        assert counted and set(counted) == {held}
    assert reply.usage.prompt_tokens > 256


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


def test_a_family_refused_for_its_checkpoints_processor_code_has_none_in_mlx_vlm() -> None:
    # llmjpvl's and youtu_vl's processors ship as code in their checkpoints (REFUSED says
    # why). A new mlx-vlm that ships one of its own (its main branch has, for llmjpvl)
    # fails here until the family is tried against mlx-vlm's own generate.
    import mlx_vlm.models

    refused = sorted(name for name, why in REFUSED.items() if "trust_remote_code" in why)
    assert refused == ["llmjpvl", "youtu_vl"]
    root = Path(mlx_vlm.models.__file__).parent
    for name in refused:
        sources = [f.read_text(encoding="utf-8") for f in (root / name).glob("*.py")]
        assert sources and not any(
            "ProcessorMixin" in s or "install_auto_processor_patch" in s for s in sources
        ), name


def test_a_checkpoints_model_type_of_another_name_finds_its_family() -> None:
    # Published checkpoints carry the model types mlx-vlm remaps (FastVLM's llava_qwen2,
    # Bunny's bunny-llama, LFM2-VL's lfm2-vl): each finds the family mlx-vlm loads.
    from mlx_vlm.utils import MODEL_REMAPPING

    vision = set(FAMILIES) | set(REFUSED)
    remapped = {k: v for k, v in MODEL_REMAPPING.items() if v in vision and k != v}
    assert remapped == ALIASES
    assert family_of("llava_qwen2") is FAMILIES["fastvlm"]
    assert family_of("bunny-llama") is FAMILIES["llava_bunny"]


@pytest.mark.parametrize("model_type", [*sorted(REFUSED), "muse_spark_open"])
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


@pytest.mark.parametrize(
    "model", ["tiny-llava-next", "tiny-fastvlm", "tiny-llava-bunny", "tiny-multi-modality"]
)
def test_a_prompt_counts_the_rows_its_model_embeds_where_they_outnumber_its_tokens(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    # mlx-vlm's llava_next splices a block of patches a tile, then a newline block a
    # tile: more rows than its processor writes image tokens; fastvlm's processor writes
    # one id (-200) an image, which its model replaces by the image's cells (multi_modality's
    # its config's image token, by 576 rows). The prompt
    # omlx prefills (usage, the context window, the guard's price, the prefix cache)
    # counts the rows.
    import io

    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    vlm, processor = mlx_vlm_load(server, model)
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


def test_a_moondream2_whose_hub_tokenizer_cannot_be_read_is_a_load_error_naming_it(
    tmp_path: Path,
) -> None:
    # mlx-vlm's load falls back to the bare tokenizer (no image path) when its processor
    # cannot read moondream/starmie-v1: offline with an empty Hub cache here.
    folder = build_tiny_vlm(tmp_path / "tiny-moondream2", "moondream2", image_size=378)
    info = ModelInfo("some-moondream", folder, "moondream2", "vlm", 1)
    with offline_hub(tmp_path / "empty-hub"), pytest.raises(ModelLoadError) as error:
        load_vlm(info)
    message = str(error.value)
    assert "'some-moondream'" in message and STARMIE_REPO in message
    assert "could not be reached" in message


def penalized_reference(
    server: Server, model: str, seed: int, penalty: float
) -> list[tuple[bytes, float]]:
    """Greedy tokens (bytes, logprob) of mlx-vlm's model on the prompt mlx-vlm builds
    (its embedding, its language model), each step's logits through mlx-lm's
    repetition penalty over the prompt's real token ids and the tokens so far, as
    mlx-lm's generate gives a prompt's ids to its processors (mlx-vlm 0.7.10's
    generate gives its processors none of an embedded prompt's ids)."""
    import io

    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    vlm, processor = mlx_vlm_load(server, model)
    prompt = f"<|im_start|>user\n{TEXT}<image><|im_end|>\n<|im_start|>assistant\n"
    image = Image.open(io.BytesIO(png(seed))).convert("RGB")
    index = vlm.config.image_token_index
    out = prepare_inputs(processor, images=[image], prompts=prompt, image_token_index=index)
    ids = out["input_ids"]
    embeds = vlm.get_input_embeddings(ids, out["pixel_values"]).inputs_embeds
    cache = make_prompt_cache(vlm.language_model)
    logits = vlm.language_model(ids, inputs_embeds=embeds, cache=cache).logits[:, -1]
    (penalize,) = make_logits_processors(repetition_penalty=penalty)
    context = [t for t in ids[0].tolist() if t >= 0]
    spell = TokenText(getattr(processor, "tokenizer", processor))
    pieces = []
    for _ in range(MAX_TOKENS):
        logits = penalize(mx.array(context), logits)
        token = int(mx.argmax(logits, axis=-1).item())
        logprob = (logits[0, token] - mx.logsumexp(logits[0])).item()
        pieces.append((spell.piece(token)[1], float(logprob)))
        context.append(token)
        logits = vlm.language_model(mx.array([[token]]), cache=cache).logits[:, -1]
    return pieces


@pytest.mark.parametrize("model", ["tiny-fastvlm", "tiny-llava-bunny"])
def test_a_repetition_penalty_takes_no_image_placeholder_for_a_token(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    # Their prompts hold -200 once an image row (vlm_families.PLACEHOLDER_ID), which
    # mlx-lm's repetition penalty, given as a token, would take from the logits' end
    # (penalizing token vocab-200). The image penalizes nothing: each token and its
    # logprob are those of mlx-lm's penalty over the prompt's real token ids, and so on
    # a repeat, a prefix-cache hit on the image's rows.
    penalty = 10.0
    expected = penalized_reference(server, model, 90, penalty)
    for cached in (False, True):
        reply = client.chat.completions.create(
            model=model,
            messages=ask(png(90), text=TEXT),
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            extra_body={"repetition_penalty": penalty},
        )
        assert (reply.usage.prompt_tokens_details.cached_tokens > 0) == cached
        got = [(bytes(t.bytes), t.logprob) for t in reply.choices[0].logprobs.content]
        assert [piece for piece, _ in got] == [piece for piece, _ in expected]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4)


def test_plamo2vl_two_images_go_first_in_its_one_instruction_turn_as_in_mlx_vlm(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # mlx-vlm's Plamo2VLProcessor writes the images (each its tiles, a thumbnail when
    # several) before the text of its one instruction turn, whatever the message's
    # order: the answer is mlx-vlm's generate's on that message's text.
    from mlx_vlm import load, stream_generate

    folder = next(i.path for i in server.pool.available().values() if i.name == "tiny-plamo2vl")
    vlm, processor = load(str(folder))
    images = [tmp_path / "a.png", tmp_path / "b.png"]
    images[0].write_bytes(png(70, (28, 90)))  # 3 tiles and a thumbnail
    images[1].write_bytes(png(71))
    pieces = stream_generate(
        vlm, processor, TEXT, image=[str(i) for i in images], max_tokens=MAX_TOKENS, temperature=0
    )
    spell = TokenText(processor.tokenizer)
    expected = [spell.piece(p.token)[1] for p in pieces if p.finish_reason is None]
    # The text between the images, after them, or before: the same one turn.
    parts = ask(png(70, (28, 90)), png(71), text=TEXT)[0]["content"]
    for order in ([parts[1], parts[0], parts[2]], parts[1:] + parts[:1], parts):
        messages = [{"role": "user", "content": order}]
        assert answer(client, "tiny-plamo2vl", messages) == expected
    one = chat(client, "tiny-plamo2vl", ask(png(71), text=TEXT), MAX_TOKENS)
    two = chat(client, "tiny-plamo2vl", ask(png(70, (28, 90)), png(71), text=TEXT), MAX_TOKENS)
    # 4 tiles of 4 patches more.
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + 2 + 4 * 4
    # Plain text goes to /v1/completions, as the 400 for a text-only chat says.
    plain = client.completions.create(model="tiny-plamo2vl", prompt=TEXT, max_tokens=2)
    assert plain.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("messages", "tools", "change"),
    [
        ([{"role": "user", "content": TEXT}], None, "add an image"),
        (
            [{"role": "system", "content": "be brief"}, *ask(png(1), text=TEXT)],
            None,
            "one user message",
        ),
        (
            [*ask(png(1), text=TEXT), {"role": "assistant", "content": "a square"}, *ask(png(2))],
            None,
            "one user message",
        ),
        (
            ask(png(1), text=TEXT),
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "without tools",
        ),
    ],
    ids=["text only", "system message", "two turns", "tools"],
)
def test_plamo2vl_says_what_to_send_for_a_conversation_its_processor_cannot_take(
    client: openai.OpenAI, messages: list[dict], tools: list[dict] | None, change: str
) -> None:
    kwargs: dict = {"tools": tools} if tools else {}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-plamo2vl", messages=messages, max_tokens=4, **kwargs
        )
    message = info.value.response.json()["error"]["message"]
    assert "one user message with at least one image" in message and change in message


def test_a_gemma3n_prompt_whose_image_is_cached_runs_no_vision_tower(
    client: openai.OpenAI, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its last token goes in a forward of its own with its embedding row
    # (Family.last_token_apart): after a hit holding its image, the row comes from
    # mlx-vlm's embedding without pixels, not from its MobileNetV5 tower again
    # (the answers stay mlx-vlm's: test_a_repeated_image_prompt_is_a_cache_hit...).
    from mlx_vlm.models.gemma3n.vision import VisionModel

    runs: list[int] = []
    tower = VisionModel.__call__
    monkeypatch.setattr(VisionModel, "__call__", lambda *a, **k: runs.append(1) or tower(*a, **k))
    conversation = ask(png(95), text=TEXT)
    first = chat(client, "tiny-gemma3n", conversation, MAX_TOKENS)
    assert runs == [1]  # the premise: a new image runs the tower, counted here
    again = chat(client, "tiny-gemma3n", conversation, MAX_TOKENS)
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and runs == [1]
    assert again.choices[0].message.content == first.choices[0].message.content
