"""Vision-language models through mlx-vlm's public ``load``. MLX thread only.

The engine runs a VLM's language model as it runs an LLM (``TextModel`` gives it
mlx-lm's call shape: token ids in, logits out), so its decode joins the same
continuous batch. Images enter at prefill: ``VisionEncoder.embed`` runs the
vision tower and projector and returns the prompt's input embeddings, with the
image tokens' rows replaced by the image features.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import CacheList, ChunkedKVCache, KVCache, RotatingKVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from omlx.errors import InvalidRequestError, ModelLoadError, ModuleMissingError
from omlx.memory.dims import hidden_size
from omlx.memory.vision import VisionDims, pixel_shapes, vision_dims
from omlx.mlx_types import flat_parameters
from omlx.models.cross_attention import CrossAttentionStates, batched_forward
from omlx.models.discovery import ModelInfo
from omlx.models.image_ids import (
    collapsed,
    numbered_as_one,
    require_one_id_an_image,
    spliced,
    with_image_run,
)
from omlx.models.remote_code import library_refusal
from omlx.models.vlm_caches import SharedKV, StateCache, kv_shared_sources
from omlx.models.vlm_families import Family, family
from omlx.models.vlm_processors import served_processor
from omlx.models.vlm_refusals import missing_module, refusal
from omlx.models.vlm_rope import rope_each_token

log = logging.getLogger(__name__)

# Multi-axis rope (M-RoPE, vlm_families.Family.mrope): an image's tokens take (t, h, w)
# grid positions, so the text after it sits at fewer positions than its index. omlx
# shifts the whole image prompt's positions up by that difference (rope depends
# only on differences of positions: the same attention) so that every token after
# the last image, and every decode step, sits at its index (its cache offset): the
# shared decode batch needs no per-row state. The shift depends on the prompt's
# images only, and the prefix cache keys image prompts by their images' hashes.


# mlx-lm's cache of a language model layer of mlx-vlm, and as the image path makes it.
_Served = KVCache | RotatingKVCache | ChunkedKVCache | StateCache | CacheList
_Layer = _Served | CrossAttentionStates


class TextModel(nn.Module):
    """A VLM's language model in mlx-lm's shape: ``model(ids, cache=...)`` -> logits.
    ``cross_layers``: the layers that cross-attend image states (mllama)."""

    def __init__(
        self,
        language_model: Any,
        mrope: bool = False,
        cross_layers: tuple[int, ...] = (),
        mrope_axes_last: bool = False,
        last_token_apart: bool = False,
        own_cache: bool = False,
        kept_positions: bool = False,
    ):
        super().__init__()
        self.language_model = language_model
        # M-RoPE: positions are always passed, never left to the model's own state
        # (it keeps the last prompt's rope deltas, wrong for other rows of a batch).
        self._mrope = mrope
        self._mrope_axes_last = mrope_axes_last
        self._cross_layers = cross_layers
        self._shared_sources = kv_shared_sources(language_model)
        self._last_token_apart = last_token_apart
        self._own_cache = own_cache
        self._kept_positions = kept_positions

    @property
    def layers(self) -> list[Any]:
        return list(self.language_model.layers)

    @property
    def last_token_apart(self) -> bool:
        """A text prompt feeds its last token apart, as mlx-vlm's generate does, never
        in one pass with the rest: mllama's cross layers' text-only path attends a
        forward's tokens both ways; Family.last_token_apart (gemma3n)."""
        return bool(self._cross_layers) or self._last_token_apart

    def make_cache(self) -> list[_Layer]:
        if self._own_cache:  # Family.own_cache: the model's own classes, run alone
            return _vlm_caches(self.language_model)
        # mlx-lm's cache types in the language model's own layout (sliding windows
        # included): the batch and the prefix cache know them.
        caches: list[_Layer] = [_mlx_lm_cache(c) for c in _vlm_caches(self.language_model)]
        for i in self._cross_layers:
            caches[i] = CrossAttentionStates()
        return caches

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: Any = None,
        positions: mx.array | None = None,
        **prompt_inputs: Any,
    ) -> mx.array:
        """``positions``: an image prompt's chunk of (3, 1, tokens) M-RoPE positions;
        ``prompt_inputs``: PromptEmbedding.prompt_inputs, with each of its chunks."""
        kwargs = dict(prompt_inputs)
        if self._shared_sources and cache is not None:
            cache = [*cache, *(SharedKV(cache[i]) for i in self._shared_sources)]
        if self._cross_layers and cache is not None:
            states = kwargs.get("cross_attention_states")
            if states is None:
                # A text chunk or a decode step: each row's own states (or none).
                return batched_forward(
                    self.language_model, inputs, cache, self._cross_layers, input_embeddings
                )
            # An image prompt's prefill (one row, with its masks): mlx-vlm's forward.
            held: CrossAttentionStates = cache[self._cross_layers[0]]
            held.hold(states)
        if self._kept_positions:
            # Family.kept_positions: the model would rope a forward from the cache's start
            # by the positions of whichever prompt it saw last (another request's); this
            # forward's own come with it (an image prompt's input) or from its ids.
            self.language_model._position_ids = None
        if self._mrope:
            chunk = positions if positions is not None else _index_positions(inputs, cache)
            kwargs["position_ids"] = chunk.transpose(1, 2, 0) if self._mrope_axes_last else chunk
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, **kwargs)
        logits: mx.array = out.logits if hasattr(out, "logits") else out
        return logits


def _vlm_caches(language_model: Any) -> list[Any]:
    make = getattr(language_model, "make_cache", None)
    return list(make()) if callable(make) else [KVCache() for _ in language_model.layers]


def _mlx_lm_cache(cache: Any) -> _Served:
    """mlx-lm's equivalent of one of mlx-vlm's own cache layers: the classes the text
    path serves (a ChunkedKVCache cannot batch: the load's probe runs such a model one
    request at a time, as mlx-lm's llama4)."""
    kind = type(cache).__name__
    if kind == "KVCache":
        return KVCache()
    if kind == "RotatingKVCache":
        return RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
    if kind == "ArraysCache":
        return StateCache(len(cache.cache))
    if kind == "ChunkedKVCache":
        return ChunkedKVCache(cache.chunk_size)
    if kind == "CacheList":  # a layer's several caches (inkling's KV and convolutions)
        return CacheList(*(_mlx_lm_cache(c) for c in cache.caches))
    raise ValueError(
        f"a {kind} layer (only KVCache, RotatingKVCache, ChunkedKVCache and ArraysCache "
        "layers, and CacheLists of them, are served)"
    )


def _index_positions(inputs: mx.array, cache: list[Any] | None) -> mx.array:
    """(3, rows, tokens) positions of tokens at their index: each row's cache offset
    onwards (an int for one sequence, one per row for a batch's cache)."""
    rows, length = inputs.shape
    # The first attention layer's (a linear-attention layer's state has no offset).
    offset = next((c.offset for c in cache or () if hasattr(c, "offset")), 0)
    start = offset[:, None] if isinstance(offset, mx.array) else mx.array([[offset]])
    positions = start + mx.arange(length)[None]
    return mx.broadcast_to(positions[None], (3, rows, length))


@dataclass(frozen=True, slots=True)
class PromptEmbedding:
    """A prompt with its images, as the language model takes it: input embeddings
    (1, tokens, hidden); for M-RoPE families the positions (3, 1, tokens), shifted
    so the tokens after the last image sit at their index (None: every token at its
    index); and the whole-prompt inputs the model slices by its cache offset itself
    (Family.prompt_inputs: qwen3_vl's deepstack features)."""

    embeddings: mx.array
    positions: mx.array | None
    prompt_inputs: dict[str, Any]

    def arrays(self) -> list[mx.array]:
        """What encoding computes, to evaluate at once (mllama's tower output is
        its cross-attention states, not the embeddings)."""
        held = [v for v in self.prompt_inputs.values() if isinstance(v, mx.array)]
        return [self.embeddings, *held]


@dataclass(frozen=True, slots=True)
class VisionEncoder:
    """The whole mlx-vlm model (vision tower, projector) and its processor;
    ``family_name``: the config's model_type (``family``'s key)."""

    model: Any
    processor: Any
    family_name: str
    family: Family
    image_token: str
    image_token_id: int
    dims: VisionDims

    @property
    def image_text(self) -> str:
        """What stands for one image in the prompt text (the processor expands it)."""
        text = self.family.image_text
        if text is not None and self.family.numbered_images is not None:
            return text.format(n=1)
        return self.image_token if text is None else text

    def with_image_text(self, text: str, marker: str) -> str:
        """``text`` with each image's ``marker`` replaced by what stands for it (image
        n's number filled in, where the family numbers them: phi3_v)."""
        numbered = self.family.image_text
        if self.family.numbered_images is None or numbered is None:
            return text.replace(marker, self.image_text)
        written = re.search(re.escape(numbered).replace(r"\{n\}", r"\d+"), text)
        if written is not None:
            # The processor would take it for an image (one it has no pixels for).
            raise InvalidRequestError(
                f"a message's text writes the image marker '{written.group()}' itself, "
                "which this model's processor takes for an image; remove it from the text"
            )
        first, *after = text.split(marker)
        return first + "".join(numbered.format(n=n) + p for n, p in enumerate(after, 1))

    def prompt_ids(
        self, processed: list[int], pixel_shape: Sequence[int], extras: Mapping[str, Any]
    ) -> list[int]:
        """The prompt as omlx prefills it, from the processor's ids: one id a row of
        the model's embedding (Family.image_blocks: the image's token repeated once a
        row of its blocks). ``extras``: the processor's other outputs. Pure: runs on
        the render pool."""
        numbered = self.family.numbered_images
        if numbered is not None:
            expected = sum(numbered(size) for size in np.asarray(extras["image_sizes"]))
            return numbered_as_one(processed, self.image_token_id, expected, self.image_text)
        rows = self._image_rows(pixel_shape, extras)
        if rows is not None:
            num_images = int(pixel_shape[0])
            require_one_id_an_image(processed, self.image_token_id, num_images, self.image_text)
            return spliced(processed, self.image_token_id, rows)
        rule = self.family.image_blocks
        if rule is None:
            return processed
        most, block = rule(pixel_shape, self.dims.patch_size)
        blocks = min(processed.count(self.image_token_id), most)
        return with_image_run(processed, self.image_token_id, blocks * block)

    def _model_ids(
        self, prompt: list[int], pixel_shape: Sequence[int], extras: Mapping[str, Any]
    ) -> list[int]:
        """``prompt_ids``' inverse as the model takes it: a token a block (the model
        splices the same rows for these as for the processor's ids)."""
        rows = self._image_rows(pixel_shape, extras)
        if rows is not None:
            return collapsed(prompt, self.image_token_id, rows)
        rule = self.family.image_blocks
        if rule is None:
            return prompt
        block = rule(pixel_shape, self.dims.patch_size)[1]
        return with_image_run(
            prompt, self.image_token_id, prompt.count(self.image_token_id) // block
        )

    def _image_rows(
        self, pixel_shape: Sequence[int], extras: Mapping[str, Any]
    ) -> Iterator[int] | None:
        """Each image's rows in prompt order, where an image is one placeholder id
        (Family.image_rows, image_grids); None where it is not."""
        if self.family.image_grids is not None:
            grids = np.asarray(extras[self.family.image_grids])
            return iter([math.prod(int(v) for v in grid) for grid in grids])
        if self.family.image_rows is not None:
            return itertools.repeat(self.family.image_rows(pixel_shape))
        return None

    def embed(
        self, input_ids: list[int], pixel_values: Any, extras: dict[str, Any]
    ) -> PromptEmbedding:
        """``input_ids``: the prompt as omlx prefills it (``prompt_ids``)."""
        ids = mx.array(self._model_ids(input_ids, pixel_shapes(pixel_values)[0], extras))[None]
        # As mlx-vlm's prepare_inputs: lists stay lists (moondream's crop counts, layouts;
        # MiniCPM-V's pixels, a list of slices a prompt, which its model converts).
        kwargs = {k: v if isinstance(v, (list, str)) else mx.array(v) for k, v in extras.items()}
        pixels = pixel_values if isinstance(pixel_values, list) else mx.array(pixel_values)
        # The processor's attention mask, as mlx-vlm's generate passes it (gemma3 needs it).
        mask = mx.ones(ids.shape, dtype=mx.int32)
        features = self.model.get_input_embeddings(ids, pixels, mask=mask, **kwargs)
        embeds: mx.array = getattr(features, "inputs_embeds", features)
        inputs = {name: _prompt_input(features, kwargs, name) for name in self.family.prompt_inputs}
        if not self.family.mrope:
            return PromptEmbedding(embeds, None, inputs)
        positions, deltas = _mrope_positions(self.model, features, ids, kwargs)
        if self.family.mrope_axes_last:
            positions = positions.transpose(2, 0, 1)
        shifted = (positions - mx.array(deltas).reshape(1, -1, 1)).astype(mx.int32)
        return PromptEmbedding(embeds, shifted, inputs)

    def embed_text(self, input_ids: list[int]) -> PromptEmbedding:
        """A prompt as mlx-vlm's generate embeds it without pixels (its model's
        get_input_embeddings): a text prompt of a family whose text embeds otherwise
        there than by id (Family.last_token_apart: gemma3n's unscaled rows, its
        per-layer inputs), or one whose image tokens the prefix cache holds (only its
        text rows are read, so the vision tower need not run again)."""
        ids = mx.array(input_ids)[None]
        features = self.model.get_input_embeddings(ids, None, mask=mx.ones(ids.shape, mx.int32))
        embeds: mx.array = getattr(features, "inputs_embeds", features)
        inputs = {name: _prompt_input(features, {}, name) for name in self.family.prompt_inputs}
        return PromptEmbedding(embeds, None, inputs)

    def stress_inputs(self) -> tuple[list[int], Any, dict[str, Any]]:
        """A prompt with one image at the processor's largest size (ids, pixels,
        extras): the auto-profile's image pass."""
        from PIL import Image

        side = _largest_side(self.processor)
        image = Image.new("RGB", (side, side), (128, 96, 64))
        text = f"{self.image_text} describe"
        out = self.processor(text=text, images=[image], return_tensors="np")
        extras = {k: v for k, v in out.items() if k not in _TEXT_FIELDS}
        pixels = out["pixel_values"]
        processed = [int(t) for t in out["input_ids"][0]]
        return self.prompt_ids(processed, pixel_shapes(pixels)[0], extras), pixels, extras


_TEXT_FIELDS = ("input_ids", "attention_mask", "pixel_values")


def _prompt_input(features: Any, processed: dict[str, Any], name: str) -> Any:
    """A whole-prompt input from mlx-vlm's embedding output, or where the model takes
    it from the processor's (gemma4_unified's mm_token_type_ids, which mlx-vlm's
    generate passes to the language model with the prompt)."""
    value = getattr(features, name, None)
    return processed.get(name) if value is None else value


def _mrope_positions(
    model: Any, features: Any, ids: mx.array, processed: dict[str, Any]
) -> tuple[mx.array, Any]:
    """An image prompt's positions (in the family's layout) and its rope delta, from
    the embedding output (qwen2_vl ...); where the family keeps them on its language
    model for its own next call (glm4v), from there; else from the language model's
    get_rope_index, which it runs at its first forward (ernie4_5_moe_vl)."""
    positions = getattr(features, "position_ids", None)
    if positions is not None:
        return positions, features.rope_deltas
    language_model = model.language_model
    if getattr(language_model, "_position_ids", None) is not None:
        return language_model._position_ids, language_model._rope_deltas
    found: tuple[mx.array, Any] = language_model.get_rope_index(
        ids, image_grid_thw=processed.get("image_grid_thw")
    )
    return found


# The image pass's side when a processor names no size; and at most (a larger image
# costs more, and its attention is quadratic in the patches, as the formula has it).
_DEFAULT_SIDE = 336
_MAX_STRESS_SIDE = 1024


def _largest_side(processor: Any) -> int:
    """The largest edge the image processor resizes to (size / crop_size entries)."""
    image_processor = getattr(processor, "image_processor", None)
    sides = []
    for name in ("size", "crop_size"):
        entry = getattr(image_processor, name, None)
        found = entry if isinstance(entry, dict) else getattr(entry, "__dict__", {})
        # Edges only (shortest_edge, height, ...), not min_pixels / max_pixels areas.
        sides += [v for k, v in found.items() if isinstance(v, int) and v > 0 and "pixels" not in k]
    return min(max(sides, default=_DEFAULT_SIDE), _MAX_STRESS_SIDE)


def _image_token(processor: Any, config: dict[str, Any], traits: Family) -> tuple[str, int]:
    tokenizer = getattr(processor, "tokenizer", processor)
    if traits.image_token_id is not None and traits.image_token_id < 0:
        # A placeholder outside the vocabulary (mlx-vlm's -200): no token spells it.
        return traits.image_text or "<image>", traits.image_token_id
    if traits.image_token_id is not None:
        fixed = traits.image_token_id
        return str(tokenizer.convert_ids_to_tokens(fixed)), fixed
    token = traits.image_token or getattr(processor, "image_token", None) or "<image>"
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if traits.image_token or not isinstance(token_id, int):
        token_id = int(tokenizer.convert_tokens_to_ids(token))
    return str(token), token_id


class SplitPromptProcessor:
    """mlx-vlm's prompt for a model whose processor is its tokenizer with mlx-vlm's own
    image processor beside it (llava_bunny), as its prepare_inputs builds it: the text
    before and after the first "<image>" tokenized apart (each as the tokenizer
    encodes a text), -200 between, the text after a second image dropped; the pixels
    the image processor's, stacked. Pure: runs on the render pool."""

    def __init__(self, tokenizer: Any, image_token_id: int):
        self.tokenizer = tokenizer
        self.image_processor = tokenizer.image_processor
        self._image_token_id = image_token_id

    def __call__(self, text: str, images: list[Any], return_tensors: str = "np") -> Any:
        import numpy as np

        chunks = [self.tokenizer(chunk).input_ids for chunk in text.split("<image>")]
        ids = chunks[0] + [self._image_token_id] + (chunks[1] if len(chunks) > 1 else [])
        pixels = np.stack(self.image_processor.preprocess(images=images))
        return {"input_ids": np.array([ids]), "pixel_values": pixels}


def _processor(processor: Any, model: Any, info: ModelInfo) -> Any:
    """The processor omlx's image path calls: mlx-vlm's (or the one it needs torch for,
    on transformers' PIL backend), or where mlx-vlm's generate builds the prompt itself
    around a bare tokenizer, that prompt's builder (with the placeholder it writes:
    the model config's image_token_index)."""
    from mlx_vlm.models.base import BaseImageProcessor

    processor = served_processor(info.model_type, info.path, processor)
    if isinstance(getattr(processor, "image_processor", None), BaseImageProcessor):
        return SplitPromptProcessor(processor, int(model.config.image_token_index))
    return processor


def _stop_ids(processor: Any) -> list[int]:
    """The tokens mlx-vlm's generate stops at: its processor's stopping criteria (the
    config's eos_token_id with the tokenizer's own; moondream2's Hub tokenizer names
    another end than its config's <|endoftext|>)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    stopping = getattr(tokenizer, "stopping_criteria", None)
    return [int(t) for t in getattr(stopping, "eos_token_ids", None) or ()]


def load_vlm(info: ModelInfo) -> tuple[TextModel, Any, dict[str, Any], VisionEncoder]:
    """(text model, tokenizer, config, vision encoder); failures are ModelLoadError."""
    traits = family(info.model_type)
    if traits is None:
        raise ModelLoadError(f"cannot load '{info.name}': {refusal(info.model_type)}")
    missing = missing_module(info.model_type)
    if missing is not None:
        raise ModuleMissingError(f"cannot load '{info.name}': {missing}")
    from mlx_vlm.utils import load  # deferred: heavy import

    start = time.perf_counter()
    try:
        # mlx-vlm's default is True (its AutoProcessor patch, its processors).
        model, processor = load(str(info.path), trust_remote_code=info.trust_remote_code)
    except (ValueError, OSError, KeyError, RuntimeError, TypeError) as exc:
        raise library_refusal(info.name, exc) or ModelLoadError(
            f"cannot load '{info.name}' from {info.path}: {exc}"
        ) from exc
    if not traits.own_cache:
        _require_served_caches(info, model.language_model)
    # LongRoPE's short or long factors by each token's position, not the batch's longest
    # row's (models/vlm_rope.py): a batched row answers as it would alone.
    rope_each_token(model.language_model)
    _require_image_processor(info, traits, processor)
    stop_ids = _stop_ids(processor)
    processor = _processor(processor, model, info)
    config = _served_config(info, model)
    traits = family(info.model_type, config["text_config"]) or traits
    token, token_id = _image_token(processor, config, traits)
    text_hidden = hidden_size(config)
    if text_hidden is None:
        raise ModelLoadError(f"cannot load '{info.name}': its text config names no hidden size")
    dims = vision_dims(config, text_hidden, _dtype_bytes(model))
    encoder = VisionEncoder(model, processor, info.model_type, traits, token, token_id, dims)
    tokenizer = TokenizerWrapper(getattr(processor, "tokenizer", processor), eos_token_ids=stop_ids)
    log.info("loaded vision-language model %s in %.2f s", info.name, time.perf_counter() - start)
    cross = tuple(config["text_config"].get("cross_attention_layers") or ())
    text_model = TextModel(
        model.language_model,
        traits.mrope,
        cross,
        traits.mrope_axes_last,
        traits.last_token_apart,
        own_cache=traits.own_cache,
        kept_positions=traits.kept_positions,
    )
    return text_model, tokenizer, config, encoder


def _require_served_caches(info: ModelInfo, language_model: Any) -> None:
    """Every layer a cache mlx-lm's batch and the prefix cache take; another kind is
    a clear load error."""
    try:
        for cache in _vlm_caches(language_model):
            _mlx_lm_cache(cache)
    except ValueError as exc:
        raise ModelLoadError(f"cannot load '{info.name}': its language model keeps {exc}") from exc


def _require_image_processor(info: ModelInfo, traits: Family, processor: Any) -> None:
    """A family whose processor loads its tokenizer from the Hub: mlx-vlm's load gives
    the bare tokenizer where it could not (no image path), a clear load error here."""
    if traits.hub_tokenizer is not None and not hasattr(processor, "tokenizer"):
        raise ModelLoadError(
            f"cannot load '{info.name}': mlx-vlm's {info.model_type} processor loads its "
            f"tokenizer from the Hugging Face Hub repo {traits.hub_tokenizer} at every load, "
            "which could not be reached and is not in the Hub cache: connect once (or "
            "download that repo) so huggingface_hub caches it"
        )


def _served_config(info: ModelInfo, model: Any) -> dict[str, Any]:
    """config.json with its text and vision configs at the root, where the guard reads
    them (Qwen3-Omni nests both in its thinker's config)."""
    raw = _raw_config(info)
    vision = raw.get("vision_config") or (raw.get("thinker_config") or {}).get("vision_config")
    return {**raw, "vision_config": vision or {}, "text_config": _text_config(model)}


def _text_config(model: Any) -> dict[str, Any]:
    """The language model's config as mlx-vlm resolved it (defaults filled in), so
    the memory guard reads the real text dims of nested VLM configs."""
    config = getattr(model.config, "thinker_config", model.config)
    text = getattr(config, "text_config", config)  # deepseek_v41's: flat, at its root
    fields = getattr(text, "__dataclass_fields__", None)
    return {k: getattr(text, k) for k in fields} if fields else dict(vars(text))


def _dtype_bytes(model: Any) -> int:
    for _, param in flat_parameters(model):
        if mx.issubdtype(param.dtype, mx.floating):
            return int(param.dtype.size)
    return 2


def _raw_config(info: ModelInfo) -> dict[str, Any]:
    import json

    data = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
