"""What a sentence-transformers folder says about its embeddings (pure: no MLX).

The folder's ``modules.json`` lists Transformer -> Pooling -> (Normalize); the
Pooling module's ``config.json`` picks mean / cls / last-token pooling, and
``sentence_bert_config.json`` the sequence length the model was trained on.
A folder without them (a bare ``BertModel``) gets mean pooling and normalization,
the sentence-transformers defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
}
# Encoders run on our BERT code; any other model_type is a decoder run by mlx-lm.
_ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "modernbert", "nomic_bert")


@dataclass(frozen=True, slots=True)
class EmbeddingSpec:
    pooling: str  # "mean", "cls", "lasttoken" or "max"
    normalize: bool
    dimension: int
    # Longest input in tokens the model can take (its position table).
    max_tokens: int
    # Matryoshka-trained dims a client may truncate to ("dimensions"); empty: none.
    truncate_dims: tuple[int, ...]
    # "encoder" (BERT family, our own code) or "decoder" (mlx-lm's model, last token).
    family: str
    # A cross-encoder (sequence-classification head) scores pairs instead of embedding.
    cross_encoder: bool = False


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _modules(folder: Path) -> list[dict[str, Any]]:
    modules = _json(folder / "modules.json")
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def _pooling_config(folder: Path, modules: list[dict[str, Any]]) -> dict[str, Any]:
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            found = _json(folder / str(module.get("path", "")) / "config.json")
            return found if isinstance(found, dict) else {}
    found = _json(folder / "1_Pooling" / "config.json")
    return found if isinstance(found, dict) else {}


def _pooling_mode(pooling: dict[str, Any], family: str) -> str:
    for key, mode in _POOLING_KEYS.items():
        if pooling.get(key) is True:
            return mode
    return "lasttoken" if family == "decoder" else "mean"


def _max_tokens(config: dict[str, Any]) -> int:
    positions = int(config.get("max_position_embeddings") or 512)
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        # RoBERTa's positions start after the padding index.
        positions -= int(config.get("pad_token_id", 1)) + 1
    return positions


def _truncate_dims(folder: Path) -> tuple[int, ...]:
    """Matryoshka dims declared in config_sentence_transformers.json (if any)."""
    st = _json(folder / "config_sentence_transformers.json")
    dims = st.get("matryoshka_dims") if isinstance(st, dict) else None
    return tuple(sorted(d for d in dims or [] if isinstance(d, int) and d > 0))


def embedding_spec(folder: Path, config: dict[str, Any]) -> EmbeddingSpec:
    family = "encoder" if config.get("model_type") in _ENCODER_TYPES else "decoder"
    modules = _modules(folder)
    pooling = _pooling_config(folder, modules)
    has_modules = bool(modules)
    normalize = (
        any(str(m.get("type", "")).endswith("Normalize") for m in modules) if has_modules else True
    )
    archs = config.get("architectures") or []
    return EmbeddingSpec(
        pooling=_pooling_mode(pooling, family),
        normalize=normalize,
        dimension=int(pooling.get("word_embedding_dimension") or config.get("hidden_size") or 0),
        max_tokens=_max_tokens(config),
        truncate_dims=_truncate_dims(folder),
        family=family,
        cross_encoder=any(str(a).endswith("ForSequenceClassification") for a in archs),
    )
