"""Load an embedding or cross-encoder folder. Runs on the MLX thread.

BERT-family encoders run on our own MLX code (omlx/embeddings/bert.py);
decoder embedders (Qwen3-Embedding) run on mlx-lm's model, whose inner
``model`` returns the final hidden states, pooled here (last token).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omlx.embeddings.llm_rerank import RerankPrompt, YesNoHead, rerank_prompt
from omlx.embeddings.spec import EmbeddingSpec, embedding_spec
from omlx.errors import ModelLoadError
from omlx.mlx_types import flat_parameters
from omlx.models.discovery import ModelInfo
from omlx.models.loader import mlx_lm_load
from omlx.models.remote_code import require_allowed

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EmbeddingModel:
    info: ModelInfo
    config: dict[str, Any]
    spec: EmbeddingSpec
    tokenizer: Any  # tokenizers.Tokenizer, padding and truncation off
    encoder: Any  # mlx.nn.Module: (ids, type_ids, attention) -> hidden states
    head: Any  # the cross-encoder's classifier, else None
    native_context: int
    pad_id: int
    load_s: float
    # An LLM reranker's prompt pieces and answer tokens; None for other models.
    rerank_prompt: RerankPrompt | None = None

    def weights_bytes(self) -> int:
        modules = [m for m in (self.encoder, self.head) if m is not None]
        total = sum(p.nbytes for m in modules for _, p in flat_parameters(m))
        return int(total) or self.info.size_bytes


class _DecoderEncoder:
    """mlx-lm's causal model as an encoder: final hidden states (after its norm).
    Right padding is harmless here: causal attention never looks ahead."""

    def __init__(self, model: Any):
        self.model = model

    def parameters(self) -> Any:
        return self.model.parameters()

    def __call__(self, ids: Any, type_ids: Any, attention: Any) -> Any:
        return self.model.model(ids)


def _read_tokenizer(folder: Path, trust_remote_code: bool) -> Any:
    """The folder's fast tokenizer; without tokenizer.json, transformers converts the
    older files (vocab.txt, sentencepiece) into one."""
    from tokenizers import Tokenizer

    try:
        if (folder / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                str(folder), trust_remote_code=trust_remote_code
            ).backend_tokenizer
    except Exception as exc:  # tokenizers and transformers raise many types
        raise ModelLoadError(f"cannot read the tokenizer in {folder}: {exc}") from exc
    # Padding and length are ours to decide (a shipped tokenizer.json may pad to 128).
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _load_bert(folder: Path, config: dict[str, Any], spec: EmbeddingSpec) -> tuple[Any, Any]:
    import mlx.core as mx

    from omlx.embeddings.bert import BertEncoder, classifier_head, split_weights
    from omlx.embeddings.modernbert import ModernBertEncoder

    weights: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        # A .safetensors file loads as a dict (mlx types all formats' results as one).
        weights.update(cast("dict[str, mx.array]", mx.load(str(file))))
    if mx.default_device().type != mx.DeviceType.gpu:
        # The CPU backend is slow and coarse in half precision: compute in float32.
        weights = {k: v.astype(mx.float32) if _floating(v) else v for k, v in weights.items()}
    encoder_weights, head_weights = split_weights(weights)
    modern = config.get("model_type") == "modernbert"
    encoder = ModernBertEncoder(config) if modern else BertEncoder(config)
    encoder.load_weights(list(encoder_weights.items()))  # strict: names and shapes must match
    head = None
    if spec.cross_encoder:
        head = classifier_head(config, head_weights)
    # nn.Module.parameters is unannotated; untyped_calls_exclude misses inherited
    # methods (mypy issue 16651).
    mx.eval(encoder.parameters())  # type: ignore[no-untyped-call]
    return encoder, head


def _floating(array: Any) -> bool:
    import mlx.core as mx

    return bool(mx.issubdtype(array.dtype, mx.floating))


def _load_decoder(folder: Path, trust_remote_code: bool) -> Any:
    model, _tokenizer, _config = mlx_lm_load(folder, trust_remote_code)
    return _DecoderEncoder(model)


def is_llm_reranker(info: ModelInfo, spec: EmbeddingSpec) -> bool:
    """A causal LM of kind rerank (its folder name says reranker, or its per-model
    setting ``model_type: rerank``) scores yes/no; a classification head does not."""
    return info.kind == "rerank" and spec.family == "decoder" and not spec.cross_encoder


def load_embedding_model(info: ModelInfo) -> EmbeddingModel:
    """Weights, tokenizer and pooling of an embedding folder; ModelLoadError with the reason."""
    require_allowed(info.name, info.path, info.trust_remote_code)
    start = time.perf_counter()
    try:
        config = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
        spec = embedding_spec(info.path, config)
        if config.get("model_type") == "nomic_bert":
            raise ValueError("NomicBERT encoders are not supported yet")
        if spec.family == "decoder":
            encoder, head = _load_decoder(info.path, info.trust_remote_code), None
        else:
            encoder, head = _load_bert(info.path, config, spec)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot load embedding model '{info.name}': {exc}") from exc
    tokenizer = _read_tokenizer(info.path, info.trust_remote_code)
    prompt = None
    if is_llm_reranker(info, spec):
        try:
            prompt = rerank_prompt(tokenizer)
        except ValueError as exc:
            raise ModelLoadError(f"cannot load reranker '{info.name}': {exc}") from exc
        head = YesNoHead(encoder.model, prompt)
    model = EmbeddingModel(
        info,
        config,
        spec,
        tokenizer,
        encoder,
        head,
        spec.max_tokens,
        int(config.get("pad_token_id") or 0),
        time.perf_counter() - start,
        prompt,
    )
    log.info(
        "loaded embedding model %s (%s, %s pooling, %d dims) in %.2f s",
        info.name,
        info.model_type,
        spec.pooling,
        spec.dimension,
        model.load_s,
    )
    return model
