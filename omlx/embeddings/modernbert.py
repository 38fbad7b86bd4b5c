"""ModernBERT in MLX (gte-modernbert, modernbert-embed): pre-norm layers without
biases, rotary positions, GeGLU, and full attention every few layers with a
sliding window in between. MLX thread only."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

_NEG = -1e9  # an additive mask value that softmax turns into 0


def layer_plan(cfg: dict[str, Any]) -> list[tuple[bool, float]]:
    """Per layer: (full attention?, rope theta), from either config style: the Hub's
    ``global_attn_every_n_layers`` / ``*_rope_theta`` or ``layer_types`` / ``rope_parameters``."""
    count = cfg["num_hidden_layers"]
    every = int(cfg.get("global_attn_every_n_layers") or 3)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % every else "full_attention" for i in range(count)
    ]
    rope = cfg.get("rope_parameters") or {}
    full_theta = (rope.get("full_attention") or {}).get("rope_theta") or cfg.get(
        "global_rope_theta", 160000.0
    )
    local_theta = (rope.get("sliding_attention") or {}).get("rope_theta") or cfg.get(
        "local_rope_theta"
    )
    local_theta = local_theta or full_theta
    return [
        (t == "full_attention", full_theta if t == "full_attention" else local_theta) for t in types
    ]


class _Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.norm = _norm(cfg)


class _Attention(nn.Module):
    def __init__(self, hidden: int, bias: bool):
        super().__init__()
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.Wo = nn.Linear(hidden, hidden, bias=bias)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.Wi = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.Wo = nn.Linear(intermediate, hidden, bias=bias)


def _norm(cfg: dict[str, Any]) -> nn.LayerNorm:
    eps = cfg.get("norm_eps", 1e-5)
    return nn.LayerNorm(cfg["hidden_size"], eps=eps, bias=bool(cfg.get("norm_bias", False)))


class _Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int, full: bool, theta: float):
        super().__init__()
        hidden = cfg["hidden_size"]
        if index > 0:  # the first layer has no attention norm (the embeddings' norm serves)
            self.attn_norm = _norm(cfg)
        self.attn = _Attention(hidden, bool(cfg.get("attention_bias", False)))
        self.mlp_norm = _norm(cfg)
        self.mlp = _MLP(hidden, cfg["intermediate_size"], bool(cfg.get("mlp_bias", False)))
        self.heads = cfg["num_attention_heads"]
        self.full, self.theta = full, float(theta)
        exact = cfg.get("hidden_activation", "gelu") == "gelu"
        self.act = nn.gelu if exact else nn.gelu_approx

    def __call__(self, x: mx.array, full_mask: mx.array, local_mask: mx.array) -> mx.array:
        b, n, d = x.shape
        hd = d // self.heads
        h = self.attn_norm(x) if "attn_norm" in self else x
        qkv = self.attn.Wqkv(h).reshape(b, n, 3, self.heads, hd).transpose(2, 0, 3, 1, 4)
        q, k = (
            mx.fast.rope(t, hd, traditional=False, base=self.theta, scale=1.0, offset=0)
            for t in qkv[:2]
        )
        mask = full_mask if self.full else local_mask
        ctx = mx.fast.scaled_dot_product_attention(q, k, qkv[2], scale=hd**-0.5, mask=mask)
        x = x + self.attn.Wo(ctx.transpose(0, 2, 1, 3).reshape(b, n, d))
        value, gate = mx.split(self.mlp.Wi(self.mlp_norm(x)), 2, axis=-1)
        return x + self.mlp.Wo(self.act(value) * gate)


class ModernBertEncoder(nn.Module):
    """Token ids (padded, with their attention mask) -> final hidden states."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        plan = layer_plan(cfg)
        self.layers = [_Layer(cfg, i, full, theta) for i, (full, theta) in enumerate(plan)]
        self.final_norm = _norm(cfg)
        self.half_window = int(cfg.get("local_attention", 128)) // 2

    def __call__(self, ids: mx.array, type_ids: mx.array, attention: mx.array) -> mx.array:
        x = self.embeddings.norm(self.embeddings.tok_embeddings(ids))
        full = ((1.0 - attention.astype(mx.float32)) * _NEG)[:, None, None, :]
        # Sliding layers see keys within half a window on either side (inclusive).
        pos = mx.arange(ids.shape[1])
        far = mx.abs(pos[:, None] - pos[None, :]) > self.half_window
        local = full + mx.where(far, _NEG, 0.0)[None, None]
        full, local = full.astype(x.dtype), local.astype(x.dtype)
        for layer in self.layers:
            x = layer(x, full, local)
        out: mx.array = self.final_norm(x)  # nn.LayerNorm's __call__ is unannotated (Any)
        return out
