"""What differs between the mlx-vlm families omlx serves, in one table. MLX-free.

Every family runs through the same path (models/vlm.py, engine/image_prefill.py):
the vision tower embeds the prompt once, the language model prefills the
embeddings in chunks and decodes in the shared batch. A family's entry says only
what that path must do differently for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# (the pixels' shape, the tower's patch size) -> (most feature blocks, rows a block).
BlockRule = Callable[[Sequence[int], int], tuple[int, int]]


def tile_blocks(pixel_shape: Sequence[int], patch_size: int) -> tuple[int, int]:
    """mlx-vlm's llava_next / granite_vision: the first image's tiles (pixel_values[0]:
    tiles, channels, height, width) each give a block of patch features (the CLS row
    dropped: "default"), then as many newline blocks; the prompt's image tokens take
    one block each, as far as both go (its merge zips them)."""
    tiles, (height, width) = pixel_shape[1], pixel_shape[-2:]
    return 2 * int(tiles), (int(height) // patch_size) * (int(width) // patch_size)


# The pixels' shape -> the rows the model splices for each image's placeholder id.
RowRule = Callable[[Sequence[int]], int]

# mlx-vlm's IMAGE_TOKEN_INDEX: the id its LLaVA-style processors write for an image,
# outside every vocabulary (the model replaces it before any embedding lookup).
PLACEHOLDER_ID = -200


def fastvit_rows(pixel_shape: Sequence[int]) -> int:
    """mlx-vlm's fastvlm: FastViTHD's feature map, the image's side over its total
    stride of 64 (a 4x stem, then five 2x downsamplings: fixed by the tower's class),
    one row a cell; the processor gives every image the same square side."""
    height, width = pixel_shape[-2:]
    return (int(height) // 64) * (int(width) // 64)


# An image's (height, width) as the processor's image_sizes gives it -> its rows.
SizeRule = Callable[[Sequence[int]], int]


def hd_crop_rows(image_size: Sequence[int]) -> int:
    """mlx-vlm's phi3_v: the HD transform's (h, w) crops of 336 pixels and the global
    image, 144 rows each (12 x 12 merged CLIP patches), a separator row between the
    crops and the global image, and a newline row ending each of the h + 1 rows of
    12 (the model's count, which its processor writes: calc_num_image_tokens)."""
    h, w = int(image_size[0]) // 336, int(image_size[1]) // 336
    return (h * w + 1) * 144 + 1 + (h + 1) * 12


@dataclass(frozen=True, slots=True)
class Family:
    """``image_text``: what stands for one image in the prompt text, when it is not
    the processor's image token (the processor expands it to the image's tokens;
    "": nothing, the processor puts the images where the family wants them).
    ``image_token``: the token whose rows the image features fill, when it is not
    the processor's image token (molmo2's patches among its layout tokens);
    ``image_token_id``: its id, where the processor writes a fixed id, not a token's.
    ``mrope``: multi-axis rope positions (models/vlm.py shifts them so decode sits
    at each row's cache offset); ``mrope_axes_last``: the model takes them as (rows,
    tokens, axes), not (axes, rows, tokens). ``prompt_inputs``: fields of mlx-vlm's embedding
    output given to the language model with each prefill chunk (whole-prompt
    arrays it slices by its cache offset; or, where the embedding output has none,
    the processor's output of that name). ``whole_prompt``: an image prompt
    prefills in one forward with its last token, as mlx-vlm's generate does for
    it (a prompt that attends as one); the memory guard prices it so and never
    caps it into chunks. ``whole_text_prompt``: a text-only prompt too prefills in one
    forward (on the image side, embedded without images): mlx-vlm's model declines
    chunked prefill for every prompt (paligemma's bidirectional prompt: fed in chunks,
    or its last token apart, its earlier tokens would not attend the later ones, and
    the answer drifts from mlx-vlm's). ``one_at_a_time``: why the family
    cannot share the decode batch (None: it can). ``no_prefix_cache``: why its
    prompts' KV cannot be reused by another prompt (None: it can). ``max_images``:
    the most images one prompt may carry (None: the API's limit). ``image_blocks``:
    where the model splices a block of feature rows at each image token (more rows
    than tokens), its rule; omlx repeats the prompt's image token once a row, so the
    prompt's ids (the prefill, the prefix cache, the guard, usage) match the rows.
    ``image_rows``: each image is one placeholder id (``image_token_id``) that the
    model replaces by this many rows; omlx writes the id once a row, so the prompt's
    ids count the rows (the same rule, as image_blocks). ``hub_tokenizer``: the Hub
    repo mlx-vlm's processor loads its tokenizer from, whatever the model's folder
    holds (a load that could not reach it is refused, naming it).
    ``bidirectional_images``: an image's tokens attend each other both ways, under a
    block mask mlx-vlm's model lays only over a forward from the prompt's first token
    (whole_prompt with it); a prefix-cache hit serves such a prompt only when it holds
    every image token. ``image_grids``: as
    image_rows, but each image's rows are the product of its entry in this output of
    the processor (its patch grid, which the image's aspect sets).
    ``last_token_apart``: every prompt's last token goes in a forward of its own (an
    image prompt's with its embedding row and prompt inputs), as mlx-vlm's generate
    feeds it, where the model's logits depend on the forward's length; and every
    prompt, a text-only one too, is embedded by the model's get_input_embeddings as
    mlx-vlm's generate embeds it, even after a cache hit holding its images (it embeds
    text otherwise than the language model embeds ids).
    ``instruction_turn``: the processor writes one fixed instruction turn around one
    message's text, its images first (mlx-vlm's MessageFormat.PROMPT_ONLY), and takes
    no prompt without images: omlx gives it that one user message's text, and answers
    any other conversation with a 400 (api/prompts.py).
    ``own_cache``: the language model runs on its own ``make_cache()`` (mlx-vlm's cache
    classes, which mlx-lm's batch and the prefix cache do not take), each request
    alone; ``one_at_a_time`` and ``no_prefix_cache`` say why.
    ``numbered_images``: the text marks image n by ``image_text`` with ``{n}`` filled
    in, and the processor writes that image's rows itself as negative ids; this rule
    gives their count from the image's size (phi3_v's HD crops: ``image_sizes``).
    ``kept_positions``: the language model keeps the rope positions of the last prompt
    it embedded or prefilled for its next forward from the cache's start, and ropes
    only that forward by them (hunyuan_vl's XD-RoPE); omlx hands each such forward its
    own (an image prompt's, the ``position_ids`` prompt input; a text prompt's, none:
    the model computes them from its ids), and an image prompt goes in one forward
    (whole_prompt) from its first token: a prefix-cache hit serves it only when it
    holds every image token."""

    image_text: str | None = None
    image_token: str | None = None
    image_token_id: int | None = None
    mrope: bool = False
    mrope_axes_last: bool = False
    prompt_inputs: tuple[str, ...] = ()
    whole_prompt: bool = False
    whole_text_prompt: bool = False
    one_at_a_time: str | None = None
    no_prefix_cache: str | None = None
    max_images: int | None = None
    image_blocks: BlockRule | None = None
    image_rows: RowRule | None = None
    hub_tokenizer: str | None = None
    bidirectional_images: bool = False
    image_grids: str | None = None
    last_token_apart: bool = False
    instruction_turn: bool = False
    own_cache: bool = False
    numbered_images: SizeRule | None = None
    kept_positions: bool = False

    @property
    def images_from_first_token(self) -> bool:
        """An image prompt's image tokens are embedded right only by a forward from the
        prompt's first token: a prefix-cache hit must hold all of them or none."""
        return self.bidirectional_images or self.kept_positions

    @property
    def embeds_text_prompts(self) -> bool:
        """A text-only prompt too prefills on the image side, embedded as mlx-vlm's
        generate embeds it (RunnerLayout.embedded_prompts)."""
        return self.last_token_apart or self.whole_text_prompt


_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# A family whose language model keeps mlx-vlm's own cache class: each request runs
# alone on the model's own make_cache() (mlx-lm's batch merges mlx-lm's types only),
# and the prefix cache (kv_codec.py) has no layout to store and restore it.
_OWN_CACHE_ALONE = (
    "its layers keep mlx-vlm's own {} (not mlx-lm's), which omlx's batch cannot merge: "
    "each request runs alone on the model's own cache"
)
_OWN_CACHE_UNSTORED = (
    "its layers keep mlx-vlm's own {} (KV plus the {}), which the prefix cache has no "
    "layout to cut into blocks and restore"
)

# Tested against mlx-vlm's own generate on tiny random models (tests/api/test_vision.py,
# tests/api/test_vision_families.py).
FAMILIES: dict[str, Family] = {
    "llava": Family(),
    # AnyRes tiles, each a block of patches, then a newline block a tile (one image:
    # mlx-vlm's model embeds the first image's tiles only).
    "llava_next": Family(image_blocks=tile_blocks, max_images=1),
    # llava_next's layout over a SigLIP tower (no CLS row: its "full" features).
    "granite_vision": Family(image_blocks=tile_blocks, max_images=1),
    # AnyRes tiles with a newline row each (the processor counts them); a qwen2 decoder.
    "llava_onevision": Family(),
    "mistral3": Family(),
    "pixtral": Family(),
    "qwen2_vl": Family(image_text=_QWEN_IMAGE, mrope=True),
    "qwen2_5_vl": Family(image_text=_QWEN_IMAGE, mrope=True),
    # Deepstack: tower features added to the first decoder layers' outputs at the
    # image tokens; decode (text only) needs none of it.
    "qwen3_vl": Family(
        image_text=_QWEN_IMAGE,
        mrope=True,
        prompt_inputs=("visual_pos_masks", "deepstack_visual_embeds"),
    ),
    # Qwen3-VL with a mixture-of-experts decoder (mlx-lm's switch layers batch as any).
    "qwen3_vl_moe": Family(
        image_text=_QWEN_IMAGE,
        mrope=True,
        prompt_inputs=("visual_pos_masks", "deepstack_visual_embeds"),
    ),
    # Qwen3-Omni's thinker: Qwen3-VL-MoE's layout, M-RoPE and deepstack (its features
    # one row a prompt token, which the model slices by its cache offset); an audio
    # tower omlx does not feed, and no talker: text answers only.
    "qwen3_omni_moe": Family(
        image_text=_QWEN_IMAGE,
        mrope=True,
        prompt_inputs=("visual_pos_masks", "deepstack_visual_embeds"),
    ),
    # Qwen2-VL's image layout and M-RoPE (its positions kept on the language model).
    "glm4v": Family(image_text="<|begin_of_image|><|image|><|end_of_image|>", mrope=True),
    "glm4v_moe": Family(image_text="<|begin_of_image|><|image|><|end_of_image|>", mrope=True),
    # Sliding-window layers: mlx-lm's RotatingKVCache, which batches and caches.
    "gemma3": Family(image_text="<start_of_image>"),
    # Gemma 4: sliding-window layers as gemma3's; the processor expands each image to its
    # own number of soft tokens between the image markers. Per-layer inputs (E2B, E4B):
    # mlx-vlm computes the prompt's from its text tokens only (image tokens as 0), the
    # model slices them by its cache offset; decode steps compute them from their ids.
    # (Its larger checkpoints' image tokens attend each other both ways: GEMMA4_BIDIRECTIONAL.)
    "gemma4": Family(prompt_inputs=("per_layer_inputs",)),
    # Gemma 3n: per-layer inputs as gemma4's; its last layers attend their source
    # layers' KV (models/vlm_caches.py SharedKV gives them the keys written, in the batch too).
    # Checked on a tiny model: mlx-vlm's KV-shared layers rope their queries at the
    # cache's offset after the forward (shifted by the forward's length), so only a
    # one-token forward samples as mlx-vlm's generate, which feeds the prompt's last
    # token apart with its embedding row: its get_input_embeddings embeds every prompt's
    # text unscaled (a text-only prompt's too), its language model scales ids by
    # sqrt(hidden) (decode steps); text-only prompts too are embedded there (checked).
    "gemma3n": Family(
        prompt_inputs=("per_layer_inputs",),
        last_token_apart=True,
        one_at_a_time="mlx-vlm's KV-shared layers rope queries by the forward's length: a "
        "batch's left-padded prompts would sample other tokens than each alone, and the "
        "batch takes an image prompt's last token by id, not by its embedding row",
    ),
    # The images first: mlx-vlm places the image features at the prompt's first
    # tokens, and the processor puts images there (then BOS) when the text names none.
    # Bidirectional attention (mlx-vlm's default for PaliGemma: no mask at all): a
    # batch's left padding would be attended, and a prompt's KV depends on every
    # token of its prefill chunk, so no other prompt may reuse it. mlx-vlm's
    # chunked_prefill_policy declines chunks then, for a text-only prompt too: fed as
    # 42 tokens then its last, tiny-paligemma's 43-token text prompt answered as
    # mlx-vlm for 6 tokens, then not; in one forward, all 10 (whole_text_prompt).
    "paligemma": Family(
        image_text="",
        whole_prompt=True,
        whole_text_prompt=True,
        one_at_a_time="paligemma attends bidirectionally with no mask: in a batch, its rows "
        "would attend the other rows' padding",
        no_prefix_cache="paligemma attends bidirectionally: a token's KV depends on the "
        "tokens after it, so no other prompt can reuse it",
        # mlx-vlm places one image's features at the prompt's first tokens.
        max_images=1,
    ),
    # A cohere2 decoder: sliding-window layers, as gemma3's.
    "aya_vision": Family(),
    # InternVL: "<image>" becomes the image's tiles of context tokens between <img> markers.
    "internvl_chat": Family(image_text="<image>"),
    # InternVL as transformers ships it: the same processor over a qwen3 decoder.
    "internvl": Family(image_text="<image>"),
    # A deepseek_v3 decoder (MLA, experts) over MoonViT patches merged 2x2.
    "kimi_vl": Family(),
    "kimi_k25": Family(),
    # A llama decoder; the processor writes each image between fake-token markers
    # (idefics2: a perceiver resamples its features to a fixed number of tokens).
    "idefics2": Family(),
    "idefics3": Family(),
    "smolvlm": Family(),
    # Llama 3.2 Vision: no image tokens in the sequence; cross-attention layers attend
    # the tower's states (held in their cache, a row's own in a batch:
    # models/cross_attention.py), under the prompt's per-token masks at prefill and
    # with none at decode, as mlx-vlm's generate does; a row without images takes
    # their text-only path. The last prompt token takes its mask row, so the prompt
    # goes in one forward.
    "mllama": Family(
        prompt_inputs=(
            "cross_attention_states",
            "cross_attention_mask",
            "full_text_row_masked_out_mask",
        ),
        whole_prompt=True,
        no_prefix_cache="mllama keeps a prompt's image states in its cross-attention layers' "
        "cache, not per token: the prefix cache's blocks cannot hold them",
    ),
    # Linear-attention / convolution layers (ArraysCache, as mlx-lm's hybrids): the
    # prefix cache keeps a snapshot of their states at each block boundary.
    # LFM2-VL: SigLIP2 patches unshuffled 2x2 over an lfm2 decoder (short convolutions).
    "lfm2_vl": Family(),
    # Qwen3.5: Qwen3-VL's image layout and M-RoPE (no deepstack) over gated-delta layers.
    "qwen3_5": Family(image_text=_QWEN_IMAGE, mrope=True),
    "qwen3_5_moe": Family(image_text=_QWEN_IMAGE, mrope=True),
    # MoonViT patches merged 2x2 over a kimi_linear decoder (KDA linear attention, MLA,
    # experts); the processor writes each image as its size and its tokens.
    "kimi_k3": Family(image_text="<|kimi_image_placeholder|>"),
    # A RADIO tower over a nemotron_h decoder (mamba2 layers); images only, no audio.
    # mlx-vlm 0.7.10's mamba2 scan does not mask its padded positions' decay (mlx-lm's
    # does): a batch of different lengths gives other tokens, so the load's output
    # probe (engine/output_probe.py) serves it one request at a time.
    "nemotron_h_nano_omni": Family(),
    # Molmo2: "<|image|>" becomes a low-res crop's and the high-res crops' pooled
    # patches (<im_patch>) between start, column and end tokens; the features are
    # added to the <im_patch> rows. A qwen3-like decoder.
    "molmo2": Family(image_text="<|image|>", image_token="<im_patch>"),
    # Molmo: the processor puts the image's tokens (crops of pooled <im_patch> tokens)
    # before the whole text, whatever the text says; two images would make it two
    # prompts (one a row, each with the text), so one image a prompt.
    "molmo": Family(image_text="", image_token="<im_patch>", max_images=1),
    # Moondream 3: the processor writes BOS, 729 image rows (id 0) and the text in its
    # "Question: ... Answer:" frame; one image a prompt (the model embeds one image's
    # rows). Its embedding offers a prefix mask (BOS and image attending each other),
    # which mlx-vlm's generate does not give the language model: causal, as there.
    "moondream3": Family(image_text="", image_token_id=0, max_images=1),
    # Moondream 2: moondream3's processor and layout (its embedding the same) over a
    # phi-style decoder. mlx-vlm's processor loads its tokenizer from the Hub repo
    # moondream/starmie-v1 at every load (the checkpoint's own is stale); unreachable
    # and uncached, mlx-vlm falls back to the bare tokenizer, which takes no image.
    "moondream2": Family(
        image_text="",
        image_token_id=0,
        max_images=1,
        hub_tokenizer="moondream/starmie-v1",
    ),
    # Step-3.7: a step3p5 decoder (sliding-window layers, experts); the processor takes
    # one <im_patch> a prompt and writes every image's tokens there: one image a prompt.
    "step3p7": Family(max_images=1),
    # Muse Glimmer: sliding-window layers and full ones without rope; the features fill
    # the <|patch|> tokens between the image markers.
    "muse_glimmer": Family(),
    # Granite 4 Vision: AnyRes tiles resampled by windowed QFormers (the processor counts
    # their tokens); deepstack features added to the first decoder layers' outputs at
    # the image tokens, as qwen3_vl's (whole-prompt arrays the model slices itself).
    "granite4_vision": Family(prompt_inputs=("visual_pos_masks", "deepstack_visual_embeds")),
    # Mage-VL: Qwen-VL's image pads (a ViT with 3-D rope inside the tower) over a qwen3
    # decoder with plain rope: no M-RoPE.
    "mage_vl": Family(image_text=_QWEN_IMAGE),
    # Gemma 4 unified: gemma4's decoder, patches embedded with no vision encoder. An
    # image's tokens attend each other both ways: the language model takes the
    # processor's token types (mm_token_type_ids) with the whole prompt in one forward,
    # as mlx-vlm's generate does (no chunked prefill for an image prompt).
    "gemma4_unified": Family(
        prompt_inputs=("per_layer_inputs", "mm_token_type_ids"),
        whole_prompt=True,
        no_prefix_cache="gemma4_unified's image tokens attend each other both ways, in "
        "one forward with the whole prompt: a cache hit ending inside an image would "
        "prefill the image's other tokens without it",
    ),
    # ERNIE 4.5 VL: Qwen2-VL's image layout and 3-D rope; its language model computes the
    # positions (get_rope_index, at its first forward) and takes them as (rows, tokens,
    # 3). Its vision experts take the image tokens only where the forward gets
    # token_type_ids, which mlx-vlm's generate does not pass: every token takes the text
    # experts, as there.
    "ernie4_5_moe_vl": Family(
        image_text="<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>",
        mrope=True,
        mrope_axes_last=True,
    ),
    # MiMo-V2: Qwen-VL's image pads over a decoder with plain rope, sliding-window
    # layers with attention sinks (mlx-lm's RotatingKVCache) and experts; no audio.
    "mimo_v2": Family(image_text=_QWEN_IMAGE),
    # FastVLM: mlx-vlm's processor writes -200 for each "<image>" between the text's
    # tokens and the model splices the image's FastViTHD cells there (a qwen2 decoder).
    "fastvlm": Family(image_text="<image>", image_token_id=PLACEHOLDER_ID, image_rows=fastvit_rows),
    # Bunny: mlx-vlm's processor is the bare tokenizer beside the model's own image
    # processor; its generate writes -200 between the text before and after the first
    # "<image>" (models/vlm.SplitPromptProcessor does the same) and the model splices
    # one image a prompt there, 729 rows (it asserts them: SigLIP's 27x27 patches).
    "llava_bunny": Family(
        image_text="<image>",
        image_token_id=PLACEHOLDER_ID,
        image_rows=lambda _pixel_shape: 729,
        max_images=1,
    ),
    # Jina VLM: "<|image|>" becomes a thumbnail's and the tiles' pooled patches
    # (<im_patch>, a fixed id the image processor writes) between start, column and
    # end tokens; the features are added to the <im_patch> rows. Its rope takes a
    # batch's largest cache offset for every row (mlx-vlm 0.7.10's language.py:
    # ``offset.max().item()``): on a tiny model, the load's output probe found
    # "batched output differs from solo (row 0, step 0)". One image a prompt: on two,
    # mlx-vlm's own generate fails ("Cannot reshape array of size 784 into shape
    # (1,392)": its model takes the crops of one image).
    "jina_vlm": Family(
        image_text="<|image|>",
        image_token_id=151665,
        max_images=1,
        one_at_a_time="jina_vlm's rope places every row of a batch at the longest row's "
        "offset (mlx-vlm's language model), so rows of other lengths would decode at "
        "wrong positions",
    ),
    # Phi-4 reasoning vision: mlx-vlm's processor (built on transformers' PIL backend:
    # models/vlm_processors.py) writes -200 for each "<image>"; the model splices the
    # image's unpadded SigLIP2 NaFlex patches there, as many as its (rows, columns).
    "phi4_siglip": Family(
        image_text="<image>", image_token_id=PLACEHOLDER_ID, image_grids="spatial_shapes"
    ),
    # Phi-4-multimodal: phi4_siglip's layout (-200 an "<image>", the image's unpadded
    # NaFlex patches spliced there) over a phi3-style decoder. Unquantized, mlx-vlm's load
    # merges the vision LoRA into the decoder's weights and keeps them so for images and
    # text alike (its get_input_embeddings switches the LoRA only for a prompt with
    # images or audio: to the vision LoRA, already merged; omlx feeds no audio), checked
    # on a tiny model: _active_lora "vision" after image and text-only generates. Its
    # quantized checkpoints carry both LoRAs merged (quant_predicate) and switch nothing.
    # One weights state either way: the batch and the prefix cache share it.
    "phi4mm": Family(
        image_text="<image>", image_token_id=PLACEHOLDER_ID, image_grids="spatial_shapes"
    ),
    # Phi-3.5-vision: "<|image_n|>" becomes image n's HD crops, written by the processor
    # as that many ids -n; the model splices each image's rows at its run's start (a
    # phi3 decoder: fused projections, Su-scaled rope).
    "phi3_v": Family(image_text="<|image_{n}|>", image_token_id=-1, numbered_images=hd_crop_rows),
    # Llama 4: "<|image|>" becomes the image's tiles of <|patch|> rows (the features fill
    # them) between markers. Chunked attention on three layers of four: mlx-lm's
    # ChunkedKVCache, which cannot batch (the load's probe serves it one request at a
    # time, as mlx-lm's text llama4).
    "llama4": Family(image_text="<|image|>", image_token="<|patch|>"),
    # Hunyuan-VL (HunyuanOCR): the processor writes an image as begin, its merged patch
    # rows (a newline row a merged row) and end tokens, with XD-RoPE positions (index,
    # width, height, time) for the prompt; mlx-vlm's language model keeps them for its
    # next forward from offset 0 and ropes every later forward at plain positions. A
    # tiny model (image prompt, text prompt, image prompt, each against mlx-vlm on a
    # fresh model) matches only with each forward's own positions (kept_positions).
    "hunyuan_vl": Family(
        prompt_inputs=("position_ids",),
        whole_prompt=True,
        kept_positions=True,
        one_at_a_time="hunyuan_vl's rope places every row of a batch at the batch's shared "
        "cache index (mlx-vlm's cache_position_offset), not at each row's own offset, so "
        "rows of other lengths would decode at wrong positions",
    ),
    # Cohere Compass: qwen3_vl's image layout, interleaved M-RoPE and deepstack features
    # (its own vision markers), over a Command decoder with sliding-window layers.
    "cohere_compass": Family(
        image_text="<|VISION_START|><|IMAGE_PAD|><|VISION_END|>",
        mrope=True,
        prompt_inputs=("visual_pos_masks", "deepstack_visual_embeds"),
    ),
    # MiniCPM-V 4.6: each image a thumbnail and a grid of slices, each its own array at
    # its own size (a list a prompt, as mlx-vlm's generate passes them; the gate prices
    # each slice: memory.vision.pixel_shapes); the model adds each slice's features at
    # its run of <|image_pad|> ids (the processor's image_bound). Qwen3.5's gated-delta
    # decoder, its M-RoPE positions every token's index.
    "minicpmv4_6": Family(mrope=True),
    # MiniCPM-V 4.7: 4.6's slices and decoder; canvas M-RoPE lays the thumbnail and the
    # slices on one grid (positions from the embedding, shifted as Qwen-VL's).
    "minicpmv4_7": Family(mrope=True),
    # MiniCPM-o: "<image>" becomes <image>, a resampler query's <unk> each, </image>;
    # each image one array at its own aspect (a list a prompt, as 4.6's), over Qwen3-VL's
    # decoder (its M-RoPE positions every token's index). Images only: its audio tower
    # and speech head are not fed.
    "minicpmo": Family(image_text="<image>", image_token="<unk>", mrope=True),
    # mlx-vlm's Plamo2VLProcessor writes its ja01 instruction turn (a fixed Japanese
    # instruction, the images' tiles, the text, the answer's heading) around the text it
    # is given and raises without images; its image rows are <plamo:image> tokens.
    "plamo2vl": Family(image_text="", image_token="<plamo:image>", instruction_turn=True),
    # MiniMax M3 VL: Qwen-VL's image layout (start, pads, end) over a decoder whose layers
    # after the first three are sparse attention, each with mlx-vlm's MiniMaxM3KVCache (KV
    # plus its block index's keys). A row alone takes plain rope at its cache offset, as
    # mlx-vlm's generate runs it (its language model builds 3-D positions for batches only).
    "minimax_m3_vl": Family(
        own_cache=True,
        one_at_a_time=_OWN_CACHE_ALONE.format("MiniMaxM3KVCache"),
        no_prefix_cache=_OWN_CACHE_UNSTORED.format("MiniMaxM3KVCache", "block index's keys"),
    ),
    # Qwen4-Exp: Qwen3.5's tower, image layout and M-RoPE over gated-delta layers and,
    # every fourth, QSA sparse attention with mlx-vlm's QSAKVCache (KV plus its
    # indexer's keys and positions); its linear layers keep mlx-vlm's ArraysCache.
    "qwen4_exp": Family(
        image_text=_QWEN_IMAGE,
        mrope=True,
        own_cache=True,
        one_at_a_time=_OWN_CACHE_ALONE.format("QSAKVCache"),
        no_prefix_cache=_OWN_CACHE_UNSTORED.format(
            "QSAKVCache", "indexer's keys and multimodal positions"
        ),
    ),
    # GLM-5-Next: GLM's image markers over a decoder of hyper-connections, linear
    # attention (mlx-vlm's ArraysCache) and NoPE MLA sparse attention, each such layer a
    # CacheList of KVCaches and, where its indexer picks keys, a PoolingCache (the
    # indexer's pooled keys); no rope positions: a row alone needs none.
    "glm5_next": Family(
        image_text="<|begin_of_image|><|image|><|end_of_image|>",
        own_cache=True,
        one_at_a_time=_OWN_CACHE_ALONE.format("CacheList (a PoolingCache inside)"),
        no_prefix_cache=_OWN_CACHE_UNSTORED.format(
            "CacheList (a PoolingCache inside)", "indexer's pooled keys"
        ),
    ),
    # DeepSeek-V4.1: its processor expands each placeholder into the image's span (start,
    # a row of aligner features a grid row, a newline row each, end) and gives records of
    # each span's start and patches as pixels; one DeepseekV41Cache holds every layer's
    # window, compressed groups and indexer keys. Its config is flat (text at the root).
    # Engram layers (real checkpoints': layers 1 and 14) hash each token's n-grams from
    # a token history mlx-vlm keeps on that cache (fresh each request, carried over
    # prefill chunks) and read their tables' rows from the checkpoint's safetensors
    # (mlx-vlm's load maps them, given the folder): checked on tiny models with and
    # without one (tests/api/test_vision_families.py).
    "deepseek_v41": Family(
        image_text="<｜deepseek_image｜>",
        own_cache=True,
        one_at_a_time=_OWN_CACHE_ALONE.format("DeepseekV41Cache"),
        no_prefix_cache=_OWN_CACHE_UNSTORED.format(
            "DeepseekV41Cache", "compressed groups and indexer keys of every layer"
        ),
    ),
    # Inkling: the processor writes a row of image tokens for each 40-pixel patch (no
    # resize); an HMLP tower embeds each patch to one row. Each decoder layer keeps a
    # CacheList of KV and its short convolutions' states (mlx-lm's CacheList of a
    # KVCache and an ArraysCache: the batch and the prefix cache take them); sliding
    # layers attend within a window of the plain KV, under a learned relative bias.
    # No audio: mlx-vlm's processor loads its audio feature extractor (mlx_audio.dsp),
    # which omlx installs for that, and omlx feeds it none.
    "inkling": Family(),
    # DeepSeek-VL / Janus: mlx-vlm's processor is the bare tokenizer beside its own image
    # processor (a 384-pixel square); its generate writes the config's image token between
    # the text before and after the first "<image>" (SplitPromptProcessor, as
    # llava_bunny's), and the model splices the image's 576 SigLIP rows at the first image
    # token (its text after a second image dropped: one image). Its module imports cv2
    # (optional: models/vlm_refusals.py OPTIONAL_MODULES).
    "multi_modality": Family(
        image_text="<image>", image_rows=lambda _pixel_shape: 576, max_images=1
    ),
}
SUPPORTED_FAMILIES = frozenset(FAMILIES)

# Gemma 4 whose text config says use_bidirectional_attention "vision" (26B A4B and 31B
# do; E2B and E4B leave it unset): mlx-vlm's language model lets each image's tokens
# attend each other both ways (mm_token_type_ids, from the processor), in a forward
# from the prompt's first token only, and so prefills such a prompt in one forward.
# The prefix cache keeps text prompts; an image prompt takes a hit only past its images.
GEMMA4_BIDIRECTIONAL = Family(
    prompt_inputs=("per_layer_inputs", "mm_token_type_ids"),
    whole_prompt=True,
    bidirectional_images=True,
)
MROPE_FAMILIES = frozenset(name for name, f in FAMILIES.items() if f.mrope)

# The model types published checkpoints carry for a family of another name (mlx-vlm's
# MODEL_REMAPPING, its vision entries: tests/api/test_vision_families.py checks them).
ALIASES: dict[str, str] = {
    "llava_qwen2": "fastvlm",
    "llava-qwen2": "llava_bunny",
    "bunny-llama": "llava_bunny",
    "lfm2-vl": "lfm2_vl",
    "cohere2_vision": "aya_vision",
    "granite-vision": "granite_vision",
    "granite4-vision": "granite4_vision",
    "nemotronh_nano_omni_reasoning_v3": "nemotron_h_nano_omni",
    "nemotron_h_omni": "nemotron_h_nano_omni",
    "muse_spark_open": "muse_spark",
    "moondream1": "moondream2",
    "jvlm": "jina_vlm",
    "phi4-siglip": "phi4_siglip",
    "sam3_video": "sam3",
    "sam3.1_video": "sam3_1",
    "rf-detr": "rfdetr",
    "falcon-perception": "falcon_perception",
    "unlimited-ocr": "unlimited_ocr",
    "inkling_mm_model": "inkling",
}


def family(model_type: str, text_config: Mapping[str, Any] | None = None) -> Family | None:
    """The family's entry; ``text_config``: the checkpoint's, as mlx-vlm resolved it
    (where it changes what the path must do: Gemma 4's bidirectional images)."""
    name = ALIASES.get(model_type, model_type)
    bidirectional = (text_config or {}).get("use_bidirectional_attention")
    if name == "gemma4" and bidirectional == "vision":
        return GEMMA4_BIDIRECTIONAL
    return FAMILIES.get(name)
