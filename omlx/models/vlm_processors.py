"""Processors mlx-vlm's load cannot build without PyTorch, built on transformers' PIL
image processors instead (at load, beside mlx-vlm's load).

omlx installs no torch. Where mlx-vlm 0.7.10 imports a transformers image processor
from its torchvision module, the import fails and its load falls back to the bare
tokenizer, which cannot take an image. transformers ships the same processor on PIL
and numpy (``*ImageProcessorPil``: the same resize search, patch layout, padding and
mask; its own tests hold the two backends' pixels equal within interpolation); omlx
builds mlx-vlm's processor around it with the arguments mlx-vlm gives the torch one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omlx.models.vlm_families import ALIASES


def served_processor(model_type: str, path: Path, loaded: Any) -> Any:
    """The processor omlx's image path calls for a model of ``model_type`` in ``path``:
    mlx-vlm's (``loaded``), or where mlx-vlm fell back for lack of torch, the same one
    on transformers' PIL backend."""
    build = _BUILDERS.get(ALIASES.get(model_type, model_type))
    return loaded if build is None else build(path, loaded)


def phi4_siglip_processor(path: Path, loaded: Any) -> Any:
    """mlx-vlm's Phi4SigLipProcessor as its from_pretrained builds it for a NaFlex
    tower (``mm_vision_tower`` naming "naflex"), over Siglip2ImageProcessorPil.
    ``loaded``: what mlx-vlm's load returned (the tokenizer it fell back to, with the
    detokenizer its load_processor attached, which mlx-vlm's generate reads from the
    processor). A processor mlx-vlm did build is returned as it is."""
    if hasattr(loaded, "image_processor"):
        return loaded
    from mlx_vlm.models.phi4_siglip.processing_phi4_siglip import Phi4SigLipProcessor
    from transformers.models.siglip2.image_processing_pil_siglip2 import (
        Siglip2ImageProcessorPil,
    )

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    tower = str(config.get("mm_vision_tower") or "")
    if "naflex" not in tower.lower():
        # mlx-vlm's other branch (transformers' SiglipImageProcessor) loads without
        # torch: its processor did not fail for lack of it.
        return loaded
    image_processor = Siglip2ImageProcessorPil(**_siglip2_kwargs(config, tower))
    processor: Any = Phi4SigLipProcessor(image_processor, loaded)  # type: ignore[no-untyped-call]
    # As mlx-vlm's load_processor attaches it to the processor it returns.
    processor.detokenizer = getattr(loaded, "detokenizer", None)
    return processor


def _siglip2_kwargs(config: dict[str, Any], tower: str) -> dict[str, Any]:
    """The arguments mlx-vlm 0.7.10's Phi4SigLipProcessor.from_pretrained gives
    Siglip2ImageProcessor, from the same config fields and defaults."""
    patch_size = (config.get("vision_config") or {}).get("patch_size")
    if patch_size is None:
        patch_size = 14 if "patch14" in tower.lower() else 16
    return {
        "patch_size": patch_size,
        "max_num_patches": config.get("max_num_patches", 3600),
        "min_num_patches": config.get("min_num_patches", 256),
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


_BUILDERS: dict[str, Callable[[Path, Any], Any]] = {"phi4_siglip": phi4_siglip_processor}
