"""A prompt with images as a sequence the runner prefills on the side. MLX thread only.

The vision tower and projector turn the prompt's image tokens into input
embeddings once, when the request starts (the scheduler starts it only in a step
whose memory gate passed the encode: ``StepGate.may_encode``); the sequence feeds
them a gated chunk per step (solo.py), and at its last (text) token it joins the
decode batch like any side sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from omlx.cache.prefix import CacheHit
from omlx.engine.solo import BoundaryHook, SoloSequence
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
    # follows the last image is text at plain positions, whatever the family).
    if vision.image_token_id in prompt[done:]:
        embedded = vision.embed(prompt, images.pixel_values, images.extras)
        mx.eval(embedded.embeddings)
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
        logprobs=request.sampling.logprobs,
        block_size=block_size,
        on_boundary=on_boundary,
    )
