"""Find MLX model folders under the model dirs and tell what kind each is.

A model folder holds ``config.json`` and safetensors weights. Folders are found
one level deep (``<dir>/<name>``) and two levels deep (``<dir>/<org>/<name>``,
named ``org/name``). Folders whose names start with "." are skipped (imports
in progress write into hidden temp folders).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx.errors import WrongModelKindError

log = logging.getLogger(__name__)

_EMBEDDING_ARCHS = (
    "BertModel",
    "RobertaModel",
    "XLMRobertaModel",
    "NomicBertModel",
    "ModernBertModel",
)
# Encoders with a sequence-classification head: cross-encoder rerankers.
_RERANK_ARCHS = (
    "BertForSequenceClassification",
    "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)
# Image-text-to-text architectures (some packs drop vision_config from config.json,
# e.g. a vision tower configured by its own file).
_VLM_ARCHS = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "PaliGemmaForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
    "MllamaForConditionalGeneration",
)
# Files that mark a sentence-transformers folder (a decoder such as Qwen3-Embedding
# has an LLM's architectures; these files say it embeds).
_ST_MARKERS = ("modules.json", "config_sentence_transformers.json", "1_Pooling/config.json")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: Path
    model_type: str  # config.json's model_type, e.g. "llama"
    kind: str  # "llm", "vlm", "embedding" or "rerank"
    # Bytes of weights a load brings in: the safetensors, less tensors it maps.
    size_bytes: int
    # The model's settings allow its loaders to import the folder's own Python code.
    trust_remote_code: bool = False


def detect_kind(config: dict[str, Any], folder: Path | None = None) -> str:
    archs = config.get("architectures") or []
    if any(a in _RERANK_ARCHS for a in archs):
        return "rerank"
    if any(a in _EMBEDDING_ARCHS or a.endswith("ForMaskedLM") for a in archs):
        return "embedding"
    if folder is not None and any((folder / m).is_file() for m in _ST_MARKERS):
        return "embedding"
    if _names_a_vision_tower(config) or any(_is_vlm_arch(a) for a in archs):
        return "vlm"
    # A causal LM: so declared, or no architectures at all (mlx-lm goes by model_type).
    causal = not archs or any(str(a).endswith("ForCausalLM") for a in archs)
    if causal and folder is not None and "reranker" in folder.name.lower():
        # A causal LM named a reranker (Qwen3-Reranker-0.6B, its MLX conversions): its
        # config is a plain LLM's, the name is what every published copy keeps.
        return "rerank"
    return "llm"


def _names_a_vision_tower(config: dict[str, Any]) -> bool:
    """A vision tower's config where the families ship it: ``vision_config``; Molmo2's
    ``vit_config``; Qwen3-Omni's in its thinker's config; Molmo's, Phi-3.5-vision's
    and Phi-4-multimodal's nowhere (their model types are VLMs: mlx-lm has none)."""
    thinker = config.get("thinker_config")
    return (
        "vision_config" in config
        or "vit_config" in config
        or (isinstance(thinker, dict) and "vision_config" in thinker)
        or config.get("model_type") in ("molmo", "phi3_v", "phi4mm")
    )


def _is_vlm_arch(arch: str) -> bool:
    # Qwen2VL..., Qwen2_5_VL..., Glm4v...: "VL" or "Vision" before the generation head.
    head = arch.removesuffix("ForConditionalGeneration")
    return arch in _VLM_ARCHS or (
        head != arch and (head.upper().endswith("VL") or "Vision" in head)
    )


_CAPABILITIES = {
    "llm": ("chat",),
    "vlm": ("chat", "vision"),
    "embedding": ("embedding",),
    "rerank": ("rerank",),
}


def capabilities(kind: str) -> list[str]:
    """What a model of ``kind`` serves, as /v1/models and the admin panel show it."""
    return list(_CAPABILITIES.get(kind, ()))


def require_kind(model: str, kind: str, wanted: str | None) -> None:
    """``wanted``: "chat" (an LLM or VLM), "embedding", or None (any kind); a
    model of another kind is a 400 naming both."""
    fits = kind in ("llm", "vlm") if wanted == "chat" else wanted in (None, kind)
    if not fits:
        raise WrongModelKindError(model, kind, wanted or "")


def with_kind(info: ModelInfo, kind: str | None) -> ModelInfo:
    """``info`` as the kind its settings give it (``model_type``), if any."""
    return info if kind is None or kind == info.kind else dataclasses.replace(info, kind=kind)


def _read_config(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("skipping %s: unreadable config.json (%s)", folder, exc)
        return None
    return config if isinstance(config, dict) else None


def _weights_bytes(folder: Path) -> int | None:
    try:
        return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    except OSError as exc:  # e.g. a dangling symlink into a deleted cache
        log.warning("skipping %s: unreadable weights (%s)", folder, exc)
        return None


# Tensors mlx-vlm maps from the files and reads a few rows a forward, never loading
# them whole: deepseek_v41's Engram hash tables (~384M rows a layer in a real
# checkpoint; models/loader.py leaves them out of a loaded model's price too).
_FILE_MAPPED_TENSORS = {"deepseek_v41": ".engram.embed."}
_MAX_HEADER_BYTES = 100 * 2**20


def _mapped_bytes(folder: Path, config: dict[str, Any]) -> int:
    """Bytes of the folder's safetensors that a model of ``config`` maps, not loads."""
    part = _FILE_MAPPED_TENSORS.get(str(config.get("model_type")))
    if part is None:
        return 0
    total = 0
    try:
        for shard in folder.glob("*.safetensors"):
            stat = shard.stat()
            mapped = _shard_mapped_bytes(shard, part, stat.st_size, stat.st_mtime_ns, stat.st_ino)
            if mapped is None:
                return 0
            total += mapped
    except OSError as exc:
        log.warning("%s: unreadable safetensors, priced whole (%s)", folder, exc)
        return 0
    return total


# Discovery runs on every request (ModelCatalog.resolve): a shard's header is parsed
# once per version of the file (size, mtime, inode), not per request.
@functools.lru_cache(maxsize=4096)
def _shard_mapped_bytes(
    shard: Path, part: str, _size: int, _mtime_ns: int, _inode: int
) -> int | None:
    """Bytes of ``shard``'s tensors whose names hold ``part``; None (logged once per
    version of the file) when its header cannot be read."""
    try:
        with shard.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(length, _MAX_HEADER_BYTES)))
        offsets = (t["data_offsets"] for k, t in header.items() if part in k)
        return int(sum(end - start for start, end in offsets))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s: unreadable safetensors header, priced whole (%s)", shard, exc)
        return None


def _model_at(folder: Path, name: str) -> ModelInfo | None:
    if not (folder / "config.json").is_file():
        return None
    config = _read_config(folder)
    size = _weights_bytes(folder)
    if config is None or not size:
        return None
    size -= _mapped_bytes(folder, config)
    return ModelInfo(
        name, folder, str(config.get("model_type", "unknown")), detect_kind(config, folder), size
    )


def _visible_dirs(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def discover_models(model_dirs: Iterable[Path]) -> dict[str, ModelInfo]:
    """Map of model name -> info. The first model dir wins on a name clash."""
    found: dict[str, ModelInfo] = {}
    for root in model_dirs:
        for child in _visible_dirs(root):
            candidates = [(child, child.name)]
            if not (child / "config.json").exists():
                candidates = [(g, f"{child.name}/{g.name}") for g in _visible_dirs(child)]
            for folder, name in candidates:
                info = _model_at(folder, name)
                if info is not None and name not in found:
                    found[name] = info
    return found
