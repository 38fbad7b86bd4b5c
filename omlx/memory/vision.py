"""The memory a prompt's images take while they are encoded at prefill.

Pure: no MLX. The image tokens themselves are prompt tokens (their KV and their
attention are priced like any token's, in budget.py); this prices what comes on
top: the pixels, the vision tower's activations and attention scores over each
image's patches, and the prompt's input embeddings. The auto-profile measures one
image's encoding at load; ``measured_transient_bytes`` scales the formula by it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Activations alive at once in a vision encoder layer, in units of hidden_size
# per patch (residual, normed input, q/k/v, attention output), plus the MLP's.
_LIVE_HIDDEN_COPIES = 6
_FLOAT32 = 4


@dataclass(frozen=True, slots=True)
class VisionDims:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    # The language model's width: the input embeddings of the whole prompt.
    text_hidden_size: int
    dtype_bytes: int
    # mllama: the tower attends over all of an image's tiles at once, and its output
    # (a text-wide row per patch) stays beside the prompt for the cross-attention layers.
    tiled_cross_attention: bool = False


def vision_dims(config: Mapping[str, Any], text_hidden_size: int, dtype_bytes: int) -> VisionDims:
    """From a VLM's config.json (its ``vision_config``), with families' defaults
    for what a config leaves out."""
    vision = config.get("vision_config") or {}
    # Molmo2 nests the tower's numbers as vit_config (at the root, as HF ships it).
    vision = vision.get("vit_config") or config.get("vit_config") or vision
    text = config.get("text_config") or {}
    # The tower's width: Qwen2-VL's embed_dim (its hidden_size is the merger's output),
    # Molmo's image_emb_dim (its hidden_size is the projector's), Step-3.7's width.
    width = _first(vision, "image_emb_dim", "width")
    hidden = int(width or max(vision.get("hidden_size") or 0, vision.get("embed_dim") or 0) or 1024)
    mlp = _first(vision, "image_mlp_dim", "intermediate_size")
    patch = _first(vision, "patch_size", "image_patch_size") or 14
    heads = _first(vision, "num_attention_heads", "num_heads", "image_num_heads", "heads")
    return VisionDims(
        hidden_size=hidden,
        intermediate_size=int(mlp or hidden * float(vision.get("mlp_ratio") or 4)),
        num_heads=int(heads or 16),
        patch_size=int(patch if isinstance(patch, int) else 14),
        text_hidden_size=text_hidden_size,
        dtype_bytes=dtype_bytes,
        tiled_cross_attention=bool(text.get("cross_attention_layers")),
    )


def vision_transient_bytes(
    dims: VisionDims, pixel_shape: Sequence[int], num_prompt_tokens: int
) -> int:
    """Peak bytes of encoding images of ``pixel_shape`` (images, channels, height,
    width; the processor pads a batch to its largest image) for a prompt of
    ``num_prompt_tokens`` tokens. An upper bound: every image counted at the
    batch's size, scores in float32. Qwen2-VL's processor gives flat patches
    (patches, features): counted as one image of all of them (an upper bound);
    molmo2's, crops of them (crops, patches, a patch's pixels): a crop an image.
    Channels may come last (moondream: crops, height, width, channels).
    Crops or tiles (llava_next, mllama: (..., tiles, channels, height, width)) count
    as images, except mllama's, whose tower attends over an image's tiles at once."""
    return encode_transient_bytes(dims, (pixel_shape,), num_prompt_tokens)


def encode_transient_bytes(
    dims: VisionDims, pixel_shapes: Sequence[Sequence[int]], num_prompt_tokens: int
) -> int:
    """``vision_transient_bytes`` of a prompt whose pixels are several arrays the tower
    encodes apart (``pixel_shapes``: MiniCPM-V's slices, each at its own size): the
    tower's bytes of each, summed (an upper bound: they run one after another), and
    the prompt's input embeddings once."""
    tower = sum(_tower_bytes(dims, shape) for shape in pixel_shapes)
    if not tower:
        return 0
    return tower + num_prompt_tokens * dims.text_hidden_size * dims.dtype_bytes


def _tower_bytes(dims: VisionDims, pixel_shape: Sequence[int]) -> int:
    """The pixels, activations, attention scores and held states of one array."""
    num_images, patches = _images_and_patches(dims, pixel_shape)
    if not num_images:
        return 0
    pixels = _prod(pixel_shape) * _FLOAT32
    per_patch = _LIVE_HIDDEN_COPIES * dims.hidden_size + dims.intermediate_size
    activations = num_images * patches * per_patch * dims.dtype_bytes
    scores = num_images * dims.num_heads * patches * patches * _FLOAT32
    return pixels + activations + scores + held_state_bytes(dims, pixel_shape)


def pixel_shapes(pixel_values: Any) -> tuple[tuple[int, ...], ...]:
    """The shape of each array the vision tower encodes apart: the processor's one
    array; or where it gives a prompt's pixels as lists of arrays of their own sizes
    (a list a prompt: mlx-vlm's MiniCPM-V, an array a slice; MiniCPM-o, an array an
    image), each array as one image of its own, (1, *its shape)."""
    if not isinstance(pixel_values, (list, tuple)):
        return (tuple(int(d) for d in pixel_values.shape),)
    slices = [s for prompt in pixel_values for s in prompt]
    # deepseek_v41's processor gives a record an image (its span's start, its patches).
    arrays = [getattr(s, "patches", s) for s in slices]
    return tuple((1, *(int(d) for d in a.shape)) for a in arrays)


def held_states(dims: VisionDims, pixel_shape: Sequence[int]) -> int:
    """The rows of image states a request keeps for its whole life (mllama: a
    text-wide row per patch of every tile of every image, in its cross-attention
    cache); 0 for a model that keeps none (its images become prompt tokens)."""
    if not dims.tiled_cross_attention:
        return 0
    num_images, patches = _images_and_patches(dims, pixel_shape)
    return num_images * patches


def held_state_bytes(dims: VisionDims, pixel_shape: Sequence[int]) -> int:
    """The bytes of ``held_states``: each row the language model's width."""
    return held_states(dims, pixel_shape) * state_row_bytes(dims)


def state_row_bytes(dims: VisionDims) -> int:
    """One held state row's bytes (mllama's cross-attention states; 0: none kept)."""
    return dims.text_hidden_size * dims.dtype_bytes if dims.tiled_cross_attention else 0


def _images_and_patches(dims: VisionDims, pixel_shape: Sequence[int]) -> tuple[int, int]:
    """How many images the tower encodes for ``pixel_shape`` and the patches of each
    (0 images: a shape the formula does not know)."""
    if len(pixel_shape) == 2:
        num_images, patches = 1, int(pixel_shape[0])
    elif len(pixel_shape) == 3 and pixel_shape[-1] == 3 * dims.patch_size**2:
        # Crops of flat patches (molmo2: crops, patches, a patch's pixels).
        num_images, patches = int(pixel_shape[0]), int(pixel_shape[1])
    elif len(pixel_shape) < 3:
        return 0, 0
    else:
        num_images = _prod(pixel_shape[:-3])
        height, width = pixel_shape[-2], pixel_shape[-1]
        if pixel_shape[-1] in (1, 3) and pixel_shape[-3] not in (1, 3):
            height, width = pixel_shape[-3], pixel_shape[-2]  # channels last (moondream)
        patches = max(1, (height // dims.patch_size) * (width // dims.patch_size)) + 1
    if dims.tiled_cross_attention and len(pixel_shape) >= 5:
        num_images, patches = num_images // pixel_shape[-4], patches * pixel_shape[-4]
    return num_images, patches


def measured_transient_bytes(estimate: int, measured_peak: int, measured_estimate: int) -> int:
    """``estimate`` scaled by what the auto-profile measured encoding an image against
    what this formula said for it (never below the formula: the measurement corrects an
    underestimate, and a noisy small reading does not shrink the bound)."""
    if measured_peak <= measured_estimate or measured_estimate <= 0:
        return estimate
    return -(-estimate * measured_peak // measured_estimate)  # ceiling


def image_bytes(
    dims: VisionDims,
    pixel_shapes: Sequence[Sequence[int]],
    num_prompt_tokens: int,
    profile: Any,
) -> int:
    """What encoding a prompt's images (each array of ``pixel_shapes``) costs, as the
    guard counts it: the formula, scaled by the load-time image pass of ``profile``
    (a KVProfile, or None)."""
    estimate = encode_transient_bytes(dims, pixel_shapes, num_prompt_tokens)
    if profile is None:
        return estimate
    return measured_transient_bytes(
        estimate, profile.image_peak_bytes, profile.image_estimate_bytes
    )


def _first(config: Mapping[str, Any], *names: str) -> Any:
    """The first of ``names`` the config gives a value (families name one thing
    differently)."""
    return next((config[n] for n in names if config.get(n)), None)


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out
