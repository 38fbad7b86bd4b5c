"""A BERT-family encoder in MLX (BERT, MiniLM, RoBERTa, XLM-R) with the
sentence-transformers poolings, and the cross-encoder head. MLX thread only."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

_ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
_PREFIXES = ("bert.", "roberta.", "model.")
# Encoder weights: BERT's (embeddings, encoder) and ModernBERT's (layers, final_norm).
_ENCODER_PARTS = ("embeddings.", "encoder.", "layers.", "final_norm.")


class _Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(max(1, cfg.get("type_vocab_size", 2)), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-12))
        # RoBERTa numbers positions from padding_idx + 1.
        roberta = cfg.get("model_type") in _ROBERTA_TYPES
        self.position_offset = int(cfg.get("pad_token_id", 1)) + 1 if roberta else 0

    def __call__(self, ids: mx.array, type_ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None, :] + self.position_offset
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        # nn.LayerNorm's __call__ is unannotated (Any).
        out: mx.array = self.LayerNorm(x + self.token_type_embeddings(type_ids))
        return out


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)


class _Dense(nn.Module):
    """``dense`` then (optionally) residual + LayerNorm, as BERT's output blocks."""

    def __init__(self, n_in: int, n_out: int, eps: float | None):
        super().__init__()
        self.dense = nn.Linear(n_in, n_out)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(n_out, eps=eps)


class _Attention(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.self = _SelfAttention(hidden)
        self.output = _Dense(hidden, hidden, eps)


class _Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.heads = cfg["num_attention_heads"]
        self.attention = _Attention(hidden, eps)
        self.intermediate = _Dense(hidden, cfg["intermediate_size"], None)
        self.output = _Dense(cfg["intermediate_size"], hidden, eps)
        exact = cfg.get("hidden_act", "gelu") == "gelu"
        self.act = nn.gelu if exact else nn.gelu_approx

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        att = self.attention.self

        def heads(t: mx.array) -> mx.array:
            return t.reshape(b, n, self.heads, d // self.heads).transpose(0, 2, 1, 3)

        q, k, v = heads(att.query(x)), heads(att.key(x)), heads(att.value(x))
        scale = (d // self.heads) ** -0.5
        ctx = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b, n, d)
        out = self.attention.output
        x = out.LayerNorm(out.dense(ctx) + x)
        ffn = self.output.dense(self.act(self.intermediate.dense(x)))
        out_x: mx.array = self.output.LayerNorm(ffn + x)  # unannotated in mlx (Any)
        return out_x


class _Encoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.layer = [_Layer(cfg) for _ in range(cfg["num_hidden_layers"])]


class _Pooler(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class _Classifier(nn.Module):
    """BertForSequenceClassification's head: pooler (tanh on [CLS]) then a linear layer."""

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.pooler = _Pooler(hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def __call__(self, hidden_states: mx.array, attention: mx.array | None = None) -> mx.array:
        # Scores the first token ([CLS]); the mask is for heads that read the last one.
        pooled = mx.tanh(self.pooler.dense(hidden_states[:, 0]))
        return self.classifier(pooled)


class BertEncoder(nn.Module):
    """Token ids (padded, with their attention mask) -> last hidden states."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)

    def __call__(self, ids: mx.array, type_ids: mx.array, attention: mx.array) -> mx.array:
        # Additive mask: padded keys get a large negative score, so no token attends to them.
        mask = ((1.0 - attention.astype(mx.float32)) * -1e9)[:, None, None, :]
        x = self.embeddings(ids, type_ids)
        mask = mask.astype(x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def pool(hidden: mx.array, attention: mx.array, mode: str) -> mx.array:
    """Sentence vectors from hidden states (B, N, D) under the padding mask (B, N)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = attention.astype(mx.int32).sum(axis=1) - 1  # right padding
        return mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    weights = attention.astype(hidden.dtype)[:, :, None]
    if mode == "max":
        return mx.where(weights > 0, hidden, mx.array(-1e9, hidden.dtype)).max(axis=1)
    summed = (hidden * weights).sum(axis=1)
    return summed / mx.maximum(weights.sum(axis=1), 1e-9)


def split_weights(weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """Encoder weights (prefix stripped) and head weights (pooler, classifier)."""
    encoder: dict[str, mx.array] = {}
    head: dict[str, mx.array] = {}
    for name, value in weights.items():
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name.startswith(("pooler.", "classifier.")):
            head[name] = value
        elif name.startswith(_ENCODER_PARTS) and not name.endswith("position_ids"):
            encoder[name] = value
    return encoder, head


class _RobertaHead(nn.Module):
    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)


class _RobertaClassifier(nn.Module):
    """(XLM-)RoBERTa's head (bge-reranker): dense, tanh, out_proj on the first token."""

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.classifier = _RobertaHead(hidden, num_labels)

    def __call__(self, hidden_states: mx.array, attention: mx.array | None = None) -> mx.array:
        head = self.classifier
        return head.out_proj(mx.tanh(head.dense(hidden_states[:, 0])))


def classifier_head(cfg: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    """The sequence-classification head in ``weights`` (BERT's or RoBERTa's layout)."""
    head: nn.Module
    if "classifier.out_proj.weight" in weights:
        num_labels = int(weights["classifier.out_proj.weight"].shape[0])
        head = _RobertaClassifier(cfg["hidden_size"], num_labels)
    elif "classifier.weight" in weights:
        num_labels = int(weights["classifier.weight"].shape[0])
        head = _Classifier(cfg["hidden_size"], num_labels)
    else:
        raise ValueError("no classifier weights (classifier.weight or classifier.out_proj)")
    head.load_weights(list(weights.items()))
    return head
