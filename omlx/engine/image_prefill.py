"""A prompt with images as a sequence the runner prefills on the side. MLX thread only.

The vision tower and projector turn the prompt's image tokens into input
embeddings once, when the request starts (the scheduler starts it only in a step
whose memory gate passed the encode: ``StepGate.may_encode``); the sequence feeds
them a gated chunk per step (solo.py), and at its last (text) token it joins the
decode batch like any side sequence. A family whose text prompts too embed otherwise
than by id, or in one forward (``embedded_prompts``: gemma3n, paligemma), prefills them
here, embedded without images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from omlx.cache.prefix import CacheHit
from omlx.engine.solo import BoundaryHook, SoloSequence
from omlx.errors import ImageEmbeddingMismatchError
from omlx.mlx_types import LanguageModel
from omlx.scheduler import Request

if TYPE_CHECKING:
    from omlx.models.vlm import VisionEncoder


def image_sequence(
    model: LanguageModel,
    vision: VisionEncoder,
    request: Request,
    *,
    sampler: Callable[[mx.array], mx.array],
    processors: list[Any],
    prefill_step_size: int,
    hit: CacheHit | None,
    block_size: int = 0,
    on_boundary: BoundaryHook | None = None,
) -> SoloSequence:
    """``vision``: the model's omlx.models.vlm.VisionEncoder; ``hit``: what the
    prefix cache held of the prompt (keyed by the images' hashes); ``on_boundary``:
    the prefix cache's snapshot at each block boundary, for models whose caches
    need them (sliding windows: gemma3)."""
    prompt, images = list(request.prompt_ids), request.images
    done = hit.num_tokens if hit is not None else 0
    embedded = None
    # The vision tower runs unless the cache already holds every image token (what
    # follows the last image is text at plain positions, whatever the family; a
    # family whose image path embeds text otherwise than by id embeds it there, without
    # the tower: a repeated image is not encoded again; a text prompt of such a family
    # comes here too: RunnerLayout.embedded_prompts).
    if images is not None and vision.image_token_id in prompt[done:]:
        embedded = vision.embed(prompt, images.pixel_values, images.extras)
    elif images is None or vision.family.last_token_apart:
        embedded = vision.embed_text(prompt)
    if embedded is not None:
        _require_row_per_token(vision, embedded.embeddings.shape[1], len(prompt))
        mx.eval(embedded.arrays())
    return SoloSequence(
        model,
        request.request_id,
        prompt,
        sampler,
        processors,
        prefill_step_size,
        cache=hit.layers if hit is not None else None,
        num_cached=done,
        embeddings=embedded.embeddings if embedded else None,
        positions=embedded.positions if embedded else None,
        prompt_inputs=embedded.prompt_inputs if embedded else None,
        whole_prompt=vision.family.whole_prompt,
        embedded_last=vision.family.last_token_apart,
        logprobs=request.sampling.logprobs,
        block_size=block_size,
        on_boundary=on_boundary,
    )


def usable_hit(vision: VisionEncoder, prompt: list[int], hit: CacheHit | None) -> CacheHit | None:
    """What of a prefix-cache hit the image prompt may take: all of it, or, where the
    family embeds images right only from the prompt's first token
    (Family.images_from_first_token), only a hit holding every image token (None:
    prefill from the first token). mlx-vlm's model lays the block mask (gemma4's
    bidirectional images) or the XD-RoPE positions (hunyuan_vl) over a forward from
    the first token only: after a shorter hit the image's tokens would attend each
    other causally, or sit at plain positions."""
    if hit is None or usable_hit_tokens(vision, prompt, hit.num_tokens) == hit.num_tokens:
        return hit
    return None


def usable_hit_tokens(vision: VisionEncoder, prompt: Sequence[int], num_tokens: int) -> int:
    """The cached tokens of ``usable_hit``, by count: the memory gate prices a prompt's
    prefill with the tokens the runner will take from the cache, not with the longest
    match (a dropped hit prefills from the first token)."""
    if not vision.family.images_from_first_token:
        return num_tokens
    return 0 if vision.image_token_id in prompt[num_tokens:] else num_tokens


def _require_row_per_token(vision: VisionEncoder, num_rows: int, num_tokens: int) -> None:
    """The prefill and the prefix cache take one embedding row per prompt token: a
    model that splices more (or fewer) image features than its processor wrote image
    tokens fails the request (this one only) rather than answer from cut-off rows.
    Checked before the embeddings are evaluated: their shape is known already."""
    if num_rows == num_tokens:
        return
    raise ImageEmbeddingMismatchError(
        "the model's image embedding does not match its prompt: mlx-vlm's "
        f"'{vision.family_name}' model embedded {num_rows} rows for the prompt's "
        f"{num_tokens} tokens, and omlx prefills one row per token; this model's image "
        "path is not supported: send the prompt without images, or use another model"
    )
