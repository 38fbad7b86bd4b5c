"""What differs between the mlx-vlm families omlx serves, in one table. MLX-free.

Every family runs through the same path (models/vlm.py, engine/image_prefill.py):
the vision tower embeds the prompt once, the language model prefills the
embeddings in chunks and decodes in the shared batch. A family's entry says only
what that path must do differently for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Family:
    """``image_text``: what stands for one image in the prompt text, when it is not
    the processor's image token (the processor expands it to the image's tokens;
    "": nothing, the processor puts the images where the family wants them).
    ``mrope``: multi-axis rope positions (models/vlm.py shifts them so decode sits
    at each row's cache offset). ``prompt_inputs``: fields of mlx-vlm's embedding
    output given to the language model with each prefill chunk (whole-prompt
    arrays it slices by its cache offset). ``whole_prompt``: an image prompt
    prefills in one forward with its last token, as mlx-vlm's generate does for
    it (a prompt that attends as one). ``one_at_a_time``: why the family
    cannot share the decode batch (None: it can). ``no_prefix_cache``: why its
    prompts' KV cannot be reused by another prompt (None: it can). ``max_images``:
    the most images one prompt may carry (None: the API's limit)."""

    image_text: str | None = None
    mrope: bool = False
    prompt_inputs: tuple[str, ...] = ()
    whole_prompt: bool = False
    one_at_a_time: str | None = None
    no_prefix_cache: str | None = None
    max_images: int | None = None


_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"

# Tested against mlx-vlm's own generate on tiny random models (tests/api/test_vision.py).
FAMILIES: dict[str, Family] = {
    "llava": Family(),
    "llava_next": Family(),
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
    # Sliding-window layers: mlx-lm's RotatingKVCache, which batches and caches.
    "gemma3": Family(image_text="<start_of_image>"),
    # The images first: mlx-vlm places the image features at the prompt's first
    # tokens, and the processor puts images there (then BOS) when the text names none.
    # Bidirectional attention (mlx-vlm's default for PaliGemma: no mask at all): a
    # batch's left padding would be attended, and a prompt's KV depends on every
    # token of its prefill chunk, so no other prompt may reuse it.
    "paligemma": Family(
        image_text="",
        whole_prompt=True,
        one_at_a_time="paligemma attends bidirectionally with no mask: in a batch, its rows "
        "would attend the other rows' padding",
        no_prefix_cache="paligemma attends bidirectionally: a token's KV depends on the "
        "tokens after it, so no other prompt can reuse it",
        # mlx-vlm places one image's features at the prompt's first tokens.
        max_images=1,
    ),
    # A llama decoder; the processor writes each image between fake-token markers.
    "idefics3": Family(),
    "smolvlm": Family(),
}
SUPPORTED_FAMILIES = frozenset(FAMILIES)
MROPE_FAMILIES = frozenset(name for name, f in FAMILIES.items() if f.mrope)


def family(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)
