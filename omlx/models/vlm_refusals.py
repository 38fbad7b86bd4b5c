"""Why omlx refuses each vision model type of mlx-vlm 0.7.10 it does not serve (pure: no
MLX). models/vlm_families.py's FAMILIES says how it serves the others;
tests/api/test_vision_families.py fails when mlx-vlm adds a type in neither table."""

from __future__ import annotations

import importlib

from omlx.models.vlm_families import ALIASES, SUPPORTED_FAMILIES

# Every other model type of mlx-vlm 0.7.10 with a vision tower, and why omlx refuses
# it (tests/api/test_vision_families.py fails when mlx-vlm adds one in neither table).
# Not chat: the model answers with something other than a conversation's next tokens.
_OCR = "an OCR / document-parsing model (page in, text or layout out), not a chat model"
_DETECT = "a detection / segmentation model (boxes, masks, poses), not a chat model"
_EMBED = "an embedding model (vectors, not text): serve it as an embedding model"
# A family whose processor only its checkpoints carry, as code (trust_remote_code).
_OWN_PROCESSOR_CODE = (
    "mlx-vlm 0.7.10 has no processor for it: its checkpoints ship their own as Python code "
    "in the model folder ({}), which transformers runs only with trust_remote_code; "
    "omlx's answers have not been checked against mlx-vlm's generate with that code, so "
    "omlx does not serve it yet"
)
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        (
            "deepseekocr",
            "deepseekocr_2",
            "dots_ocr",
            "falcon_ocr",
            "glm_ocr",
            "got",
            "indic_ocr",
            "nemotron_parse",
            "paddleocr_vl",
            "unlimited_ocr",
        ),
        _OCR,
    ),
    **dict.fromkeys(
        (
            "falcon_perception",
            "locateanything",
            "pp_doclayout_v3",
            "rfdetr",
            "rt_detr_v2",
            "sam3",
            "sam3_1",
            "sam3d_body",
            "sam3d_objects",
        ),
        _DETECT,
    ),
    **dict.fromkeys(("embedding_gemma2", "llama_nemotron_vl_embedding", "siglip"), _EMBED),
    "florence2": "a task-prompt encoder-decoder (captions, OCR, boxes), not a chat model",
    "diffusion_gemma": "a diffusion language model (it denoises blocks of tokens), not "
    "token-by-token decoding",
    "moss_image": "an image generation model, not a chat model",
    "d1_omni": "a decision model (a yes/no readout over images and audio), not a chat model",
    # mlx-vlm's get_input_embeddings ignores any image: only the text tokens are embedded.
    "qwen3_5_text": "a text-only Qwen3.5 (no vision tower: mlx-vlm embeds the text tokens "
    "and ignores images), not a vision-language model",
    # Run on a tiny model: stream_generate raises TypeError ("missing ... 'input_ids'").
    "zaya1_vl": "mlx-vlm 0.7.10's own generate cannot run it (its prefill calls the "
    "language model with inputs=, which zaya1_vl's takes as input_ids): there is no "
    "reference answer to check omlx's against",
    # Run on a tiny model of each whose processor_config.json names its own module, as the
    # published checkpoints' do (mlx-community/llm-jp-4-vl-9b-mlx-4bit's processor loads from
    # transformers_modules; tencent/Youtu-VL-4B-Instruct's too): mlx-vlm's load, called as
    # omlx calls it, raises ValueError ("contains custom code which must be executed ...
    # pass the argument `trust_remote_code=True`"). With a stand-in processor and
    # trust_remote_code, mlx-vlm's generate runs both models: only the processor is missing.
    "llmjpvl": _OWN_PROCESSOR_CODE.format("processing_llmjpvl.py"),
    "youtu_vl": _OWN_PROCESSOR_CODE.format("processing_youtu_vl.py"),
    "molmo_point": "a pointing model: its decode steps predict image points from state "
    "mlx-vlm keeps on the model object for one prompt (the image's patch keys, the ids "
    "generated so far), with logits past the vocabulary for the points; one model-wide "
    "state cannot serve a batch of prompts, nor omlx's decode, which samples from the "
    "vocabulary",
    # Run on a tiny model: mlx-vlm's load raises ImportError (PixtralProcessor requires
    # torchvision; pixtral and mistral3 load mlx-vlm's own torch-free processors, which it
    # registers for those model types only). With that processor on transformers' PIL
    # backend registered for mistral_large3, mlx-vlm's generate runs, and gives two
    # images whose embedded rows differ the same tokens and logprobs: its decoder
    # (deepseek_v3's LanguageModel) takes inputs_embeds and drops them.
    "mistral_large3": "mlx-vlm 0.7.10's model never shows the image to its decoder: the "
    "language model it takes from deepseek_v3 accepts the embeddings the vision tower "
    "fills and runs on the token ids alone, so mlx-vlm's own generate answers every image "
    "alike (and its load needs PyTorch for the checkpoint's PixtralProcessor): there is "
    "no reference answer that sees the image to check omlx's against",
    # A tiny model (tests/fixtures/tiny_vlm_configs_a.py of commit 77e9968): its saved
    # weights hold every parameter mlx-vlm's model has (image_newline, view_separator
    # too), equal from load to load and unchanged by a forward: nothing is drawn anew at
    # load. Yet in some runs get_input_embeddings returns the image rows as the image
    # token's own text embedding (6 loads of 18, 3 a process, on a busy machine; none
    # of 5 processes holding the intermediate arrays), while the tower's and the
    # projector's outputs agree: the in-place assignment that splices the features,
    # ``input_embeds[idx, image_indices] = images_in_this_batch`` (deepseek_vl_v2.py
    # line 307, into the lazily embedded tokens), does not take.
    "deepseek_vl_v2": "mlx-vlm's model now and then leaves a prompt's image rows as the "
    "image token's text embedding (its in-place splice of the image features into the "
    "embedded tokens, deepseek_vl_v2.py's process_image_features, does not take in some "
    "runs of the same weights and image): its answers cannot be checked against mlx-vlm's "
    "own generate",
    # Run on a tiny model (a sliding-window layer and a full one without rope, 4 experts,
    # a 2-layer tower; the tiny audio config transformers' config requires), mlx-vlm's
    # MuseSparkProcessor: stream_generate raises "[metal_kernel] No Metal back-end"
    # (qk_norm_rope). mlx-lm's text muse_spark is left out of the breadth test likewise.
    "muse_spark": "its language model runs mlx-vlm 0.7.10's Metal-only kernels (its "
    "attention's qk_norm_rope, its norms and expert routing: mx.fast.metal_kernel, no "
    "other path): on MLX's CPU backend, where omlx is checked, mlx-vlm's own generate "
    "raises 'No Metal back-end', so there is no reference answer to check omlx's against",
}


def refusal(model_type: str) -> str:
    """Why omlx does not serve a vision model of ``model_type``, for its load error."""
    why = REFUSED.get(ALIASES.get(model_type, model_type), "not a family mlx-vlm 0.7.10 has")
    served = ", ".join(sorted(SUPPORTED_FAMILIES))
    return f"vision-language family '{model_type}' is not supported: {why} (served: {served})"


# Served families whose mlx-vlm module imports a module omlx does not install: the
# module, and the package (pinned as the tests install it: setup.sh TEST_OPENCV_PKG) a
# load without it says to install. mlx-vlm's multi_modality imports cv2 at its top for
# the hybrid (SAM) tower's resize: opencv-python-headless is a 46 MB macOS wheel (4.14.0.94,
# arm64), too much to carry in the app for one family.
OPTIONAL_MODULES: dict[str, tuple[str, str]] = {
    "multi_modality": ("cv2", "opencv-python-headless==4.14.0.94"),
}


def missing_module(model_type: str) -> str | None:
    """What to install to load a vision model of ``model_type``, where its family needs
    an optional module that does not import here (None: nothing missing)."""
    name = ALIASES.get(model_type, model_type)
    if name not in OPTIONAL_MODULES:
        return None
    module, package = OPTIONAL_MODULES[name]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return (
            f"vision-language family '{model_type}' needs the Python module '{module}', "
            f"which omlx does not install ({exc}): install it into omlx's environment with "
            f"`pip install --no-deps {package}` (the Mac app cannot load this family)"
        )
    return None
