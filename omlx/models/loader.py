"""Load a model folder through mlx-lm's public ``load``. Runs on the MLX thread."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omlx.errors import ModelLoadError
from omlx.mlx_types import LanguageModel, flat_parameters
from omlx.models.discovery import ModelInfo
from omlx.models.remote_code import library_refusal, require_allowed

log = logging.getLogger(__name__)

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


# Modules whose tables stay in the checkpoint's files, read a few rows a forward:
# deepseek_v41's Engram hash tables (~384M rows a layer in a real checkpoint), which
# mlx-vlm's load maps and leaves in the parameter tree unread.
_FILE_MAPPED = frozenset({"OffloadedEngramEmbedding"})


def _file_mapped_bytes(module: Any) -> int:
    """Bytes of ``module``'s parameters it reads from the files, never holds."""
    mapped = (m for _, m in module.named_modules() if type(m).__name__ in _FILE_MAPPED)
    return sum(p.nbytes for m in mapped for _, p in flat_parameters(m))


@dataclass(frozen=True, slots=True)
class LoadedModel:
    info: ModelInfo
    model: LanguageModel
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]
    eos_token_ids: frozenset[int]
    # The model's own context length (None when the config does not say).
    native_context: int | None
    # Rows of the output layer (may exceed the tokenizer's vocabulary).
    vocab_size: int
    load_s: float
    # A vision-language model's vision tower and processor (omlx.models.vlm).
    vision: Any = None

    def weights_bytes(self) -> int:
        """Bytes of the loaded parameters (what the model really holds, e.g. after a
        float32 upcast), falling back to the files' size."""
        # A VLM's whole model (vision tower and projector too), not its language model.
        module = self.vision.model if self.vision is not None else self.model
        try:
            params = flat_parameters(module)
            held = sum(p.nbytes for _, p in params) - _file_mapped_bytes(module)
            return int(held) or self.info.size_bytes
        except Exception:
            return self.info.size_bytes

    def activation_bytes(self) -> int:
        """Bytes per element of the model's floating parameters (the KV cache dtype)."""
        import mlx.core as mx

        for _, param in flat_parameters(self.model):
            if mx.issubdtype(param.dtype, mx.floating):
                return int(param.dtype.size)
        return 2


def native_context_length(config: dict[str, Any]) -> int | None:
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _generation_eos(path: Path) -> set[int]:
    try:
        gen = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return set()
    eos = gen.get("eos_token_id")
    if isinstance(eos, int):
        return {eos}
    return {e for e in eos or [] if isinstance(e, int)}


def mlx_lm_load(folder: Path, trust_remote_code: bool) -> tuple[Any, Any, dict[str, Any]]:
    """mlx-lm's ``load`` of ``folder``: (model, tokenizer, config). mlx-lm hands
    ``trust_remote_code`` to the model file only: the tokenizer's goes in
    tokenizer_config (else transformers asks on stdin)."""
    from mlx_lm import load  # deferred: importing mlx-lm costs ~1 s at server start

    # mlx-lm types both of load's result shapes as one union.
    return cast(
        "tuple[Any, Any, dict[str, Any]]",
        load(
            str(folder),
            tokenizer_config={"trust_remote_code": trust_remote_code},
            return_config=True,
            trust_remote_code=trust_remote_code,
        ),
    )


def _load_llm(info: ModelInfo) -> tuple[LanguageModel, Any, dict[str, Any]]:
    try:
        model, tokenizer, config = mlx_lm_load(info.path, info.trust_remote_code)
    except ValueError as exc:
        raise library_refusal(info.name, exc) or ModelLoadError(
            f"cannot load '{info.name}': unsupported or invalid model ({exc})"
        ) from exc
    except (OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load '{info.name}' from {info.path}: {exc}") from exc
    return model, tokenizer, config


def load_model(
    info: ModelInfo,
    load_llm: Callable[[ModelInfo], tuple[LanguageModel, Any, dict[str, Any]]] | None = None,
) -> LoadedModel:
    """Load weights and tokenizer; every failure becomes ModelLoadError with the reason
    (RemoteCodeNotAllowedError: the folder ships code its settings do not let run).
    ``load_llm``: how a text model's (model, tokenizer, config) is read (a shard of it
    when distributed; default: all of it with mlx-lm's ``load``)."""
    if info.kind not in ("llm", "vlm"):
        raise ModelLoadError(
            f"model '{info.name}' is a {info.kind} model; it cannot serve chat or completions"
        )
    require_allowed(info.name, info.path, info.trust_remote_code)
    start = time.perf_counter()
    vision = None
    model: LanguageModel
    if info.kind == "vlm":
        from omlx.models.vlm import load_vlm  # deferred: imports MLX and mlx-vlm

        model, tokenizer, config, vision = load_vlm(info)
    else:
        model, tokenizer, config = (load_llm or _load_llm)(info)
    eos = set(tokenizer.eos_token_ids) | _generation_eos(info.path)
    if not eos:
        log.warning("model %s declares no end-of-sequence token", info.name)
    text_config = config.get("text_config") or {}
    vocab_size = int(config.get("vocab_size") or text_config.get("vocab_size") or len(tokenizer))
    loaded = LoadedModel(
        info,
        model,
        tokenizer,
        config,
        frozenset(eos),
        native_context_length(config),
        vocab_size,
        time.perf_counter() - start,
        vision,
    )
    log.info(
        "loaded %s (%s, %.1f MB) in %.2f s",
        info.name,
        info.model_type,
        info.size_bytes / 1e6,
        loaded.load_s,
    )
    return loaded
