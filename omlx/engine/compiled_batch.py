"""The batch's compiled decode step, layer by layer (``CompiledBatchStep``), and the
same step over several tokens per row (a speculative step's verification). MLX
thread only. Qualified models and the proof against the eager forward: compiled.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from omlx.engine.batch_cache import columns, set_columns
from omlx.engine.compiled import CompiledDecode, CompiledStep, qualifies
from omlx.engine.strategy import ExecutionStrategy
from omlx.mlx_types import LanguageModel


def batch_qualifies(model: LanguageModel) -> bool:
    """Whether ``model``'s batched decode step can run layer by layer compiled:
    a qualified architecture whose projections are plain ``nn.Linear`` (float
    weights), whose layers all use full attention, and whose RoPE is a pure
    rotation of the whole head (``nn.RoPE`` or ``Llama3RoPE``; the scaled ones
    multiply the input first)."""
    if not qualifies(model):
        return False
    attn0 = model.layers[0].self_attn
    rope = attn0.rope
    head_dim = attn0.q_proj.weight.shape[0] // attn0.n_heads
    if type(rope) not in _ROTATIONS or rope.dims != head_dim:
        return False
    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or getattr(layer, "use_sliding", False):
            return False
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(p) is not nn.Linear for p in projections):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if any(type(n) is not nn.RMSNorm for n in norms):
            return False
    return True


class CompiledBatchStep(CompiledStep):
    """The decode step of a batch (one token per row, every layer a
    ``BatchKVCache``), with each layer's projections, norms, RoPE and MLP in two
    compiled functions and the cache write and attention eager in between; and
    the same step over several tokens per row (``verify``: a speculative step's
    drafts, the same arithmetic as mlx-lm's forward of them).

    Attention is left out of the traced functions because its shape grows every
    step; the rest has the batch's shape only, so one trace per (rows, tokens
    per row) serves every layer (the layer's weights are inputs, not constants). What the step
    saves is graph nodes, each of which costs a dispatch (on the CPU backend
    a few microseconds): the eager step evaluates ~2,500 per step for SmolLM2's
    30 layers, this one ~1,250.
    - Elementwise chains are fused (RoPE alone is ~15 kernels per call eagerly).
    - RoPE's angles are worked out once per step, not twice per layer: MLX's own
      RoPE rotates a basis vector (ones where cos lands, zeros where sin does) at
      every row's offset, which gives each row's cosines and sines exactly as
      the layers' RoPE computes them; each layer then rotates with two products
      and a half swap.
    - Attention multiplies the query heads sharing a kv head as one matrix
      against that head's keys (mlx-lm's fallback multiplies them one by one),
      with the mask made once per step; the softmax scale is folded into the
      query rotation.
    - The weights go in transposed once (views, no copies).
    The arithmetic per element is mlx-lm's, in the same order, so logits and
    caches stay bit-equal to mlx-lm's forward, in fewer graph nodes and a shorter
    step (benchmarks/README.md, "Figures behind design choices"). Before its first
    step it runs once on a two-row scratch batch and must match the eager
    forward's logits, else the model's batch decodes eagerly.
    """

    max_traces = 32  # token shapes (rows, positions per row)
    name = "compiled batch step"

    def __init__(self, model: LanguageModel):
        super().__init__(model)
        attn = model.layers[0].self_attn
        self._rope = attn.rope
        self._basis = _rotation_basis(attn.rope, attn.q_proj.weight.dtype)
        # Each layer's weights as the compiled functions take them (transposed
        # views of the model's own); made on first use.
        self._weights: list[tuple[tuple[Any, ...], tuple[Any, ...]]] | None = None

    def _compile(self) -> None:
        self._pre, self._post = _compile_layer(self._model)

    @staticmethod
    def for_model(model: LanguageModel) -> CompiledBatchStep | None:
        return CompiledBatchStep(model) if batch_qualifies(model) else None

    @staticmethod
    def accepts(cache: list[Any]) -> bool:
        if not cache or any(type(c) is not BatchKVCache for c in cache):
            return False
        num = columns(cache[0])
        return all(columns(c) == num for c in cache)

    def __call__(
        self, tokens: mx.array, cache: list[Any], *, prove: bool = True
    ) -> mx.array | None:
        """Logits (rows, vocab) after feeding ``tokens`` (shape (rows,)) into the
        batch ``cache``, or None (cache untouched) when the step cannot run.
        Without ``prove``, a step that would have to run the proof first
        (once per model, a noticeable pause; see benchmarks/README.md, "Figures
        behind design choices") returns None."""
        if self.failed or not self.accepts(cache):
            return None
        if not (self._proven or (prove and self._prove())):
            return None
        return self._run(tokens[:, None], cache)

    def verify(self, tokens: mx.array, cache: list[Any]) -> mx.array | None:
        """Logits (rows, width, vocab) after feeding ``tokens`` (rows, width)
        into the batch ``cache``: a speculative step's verification forward,
        the decode step's arithmetic at every position. None (cache untouched)
        unless the step is proven (it never proves here: the pool proves at load)."""
        if self.failed or not self._proven or not self.accepts(cache):
            return None
        rows, width = tokens.shape
        return self._run(tokens, cache).reshape(rows, width, -1)

    def _run(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        shape = tokens.shape
        self._cap_traces(shape)
        self._sizes.add(shape)
        self.steps += 1
        return self._forward(tokens, cache)

    def _layer_weights(self) -> list[tuple[tuple[Any, ...], tuple[Any, ...]]]:
        if self._weights is None:
            weights = [(_pre_weights(layer), _post_weights(layer)) for layer in self._model.layers]
            mx.eval(weights)  # transposes of evaluated weights: views, no copies
            self._weights = weights
        return self._weights

    def _forward(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """Logits (rows * width, vocab) for ``tokens`` (rows, width)."""
        model: Any = self._model  # a qualifying (llama, qwen) model's internals
        inner = model.model
        width = tokens.shape[1]
        x = inner.embed_tokens(tokens.reshape(-1))  # (rows * width, hidden)
        mask = cache[0].make_mask(width)
        offset = cache[0].offset  # every layer's (the caches move in step)
        cos, sin = _rotation_tables(self._rope, self._basis, offset, width)
        for (pre, post), c in zip(self._layer_weights(), cache, strict=True):
            q, k, v = self._pre(x, cos, sin, *pre)
            keys, values = c.update_and_fetch(k, v)
            x = self._post(x, _attend(q, keys, values, mask), *post)
        # Every layer moved its offset on by ``width``; all now hold layer 0's, which the
        # next step reads. One nobody reads would grow into an unevaluated chain,
        # a node per step and layer.
        offset = cache[0].offset
        for c in cache[1:]:
            c.offset = offset
        x = inner.norm(x)
        logits: mx.array = (
            inner.embed_tokens.as_linear(x) if model.args.tie_word_embeddings else model.lm_head(x)
        )
        return logits

    def _check(self) -> bool:
        """Feed one token, then three (a verification forward), to two copies of
        a two-row scratch batch (rows of different lengths, so the left padding
        and the mask are in play), one compiled and one eager, and compare the
        logits."""
        model = self._model
        cache = [BatchKVCache(left_padding=[0, 2]) for _ in model.layers]
        model(mx.array([[0, 1, 2], [0, 0, 3]]), cache=cache)
        copy = [_copy_batch_cache(c) for c in cache]
        agree = True
        for tokens in (mx.array([[4], [5]]), mx.array([[6, 7, 8], [9, 10, 11]])):
            got = self._forward(tokens, cache).reshape(*tokens.shape, -1)
            want = model(tokens, cache=copy)
            self._sizes.add(tokens.shape)
            agree = agree and bool(mx.allclose(got, want, rtol=1e-3, atol=1e-3).item())
        return agree


def _copy_batch_cache(cache: BatchKVCache) -> BatchKVCache:
    out = BatchKVCache(left_padding=[0] * cache.left_padding.shape[0])
    # mlx-lm's BatchKVCache declares keys and values by its __init__'s None alone.
    out.keys, out.values = mx.array(cache.keys), mx.array(cache.values)  # type: ignore[assignment, arg-type]
    out.left_padding, out.offset = mx.array(cache.left_padding), mx.array(cache.offset)
    set_columns(out, columns(cache))
    return out


# RoPEs that only rotate (no input scaling), so rotating a basis vector gives
# their cosines and sines.
_ROTATIONS = (nn.RoPE, Llama3RoPE)


def _rotation_basis(rope: Any, dtype: mx.Dtype) -> mx.array:
    """A head-sized vector the RoPE turns into (cos, sin) pairs: ones where each
    pair's first element sits, zeros where its second does (interleaved pairs
    for a traditional RoPE, halves otherwise)."""
    half = rope.dims // 2
    pattern = [1.0, 0.0] * half if rope.traditional else [1.0] * half + [0.0] * half
    return mx.array(pattern, dtype=dtype).reshape(1, 1, 1, rope.dims)


def _rotation_tables(
    rope: Any, basis: mx.array, offset: mx.array, width: int
) -> tuple[mx.array, mx.array]:
    """Per row and position (shape (rows, 1, width, head)): what each element
    of a head is multiplied by, and what its swapped partner is, so that
    ``x * cos + swap(x) * sin`` is the RoPE of ``x`` at the row's offset plus
    the position.

    The RoPE of the basis is exactly the RoPE's own cosines and sines
    (1 * cos - 0 * sin, 1 * sin + 0 * cos). The partner's factor is -sin for a
    pair's first element (x1 * cos + x2 * -sin == x1 * cos - x2 * sin, bit for
    bit) and sin for its second."""
    rows = offset.shape[0]
    turned = rope(mx.broadcast_to(basis, (rows, 1, width, basis.shape[-1])), offset=offset)
    if rope.traditional:
        cos, sin = turned[..., 0::2], turned[..., 1::2]
        head = (*cos.shape[:-1], -1)
        cos_pairs = mx.stack([cos, cos], axis=-1).reshape(head)
        sin_pairs = mx.stack([-sin, sin], axis=-1).reshape(head)
        return cos_pairs, sin_pairs
    half = rope.dims // 2
    cos, sin = turned[..., :half], turned[..., half:]
    return mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1)


def _swap(x: mx.array, traditional: bool) -> mx.array:
    """Each element's RoPE partner: neighbours swapped (traditional) or halves."""
    shape = x.shape
    if traditional:
        return x.reshape(*shape[:-1], -1, 2)[..., ::-1].reshape(shape)
    return x.reshape(*shape[:-1], 2, -1)[..., ::-1, :].reshape(shape)


def _attend(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None) -> mx.array:
    """mlx-lm's attention fallback for ``width`` new tokens per row, with each kv
    head's query heads as one matrix: ``q`` (rows, kv heads, heads per kv head *
    width, head), already scaled; keys and values (rows, kv heads, length,
    head); ``mask`` (rows, 1, width, length)."""
    scores = q @ keys.swapaxes(-1, -2)
    if mask is not None:
        rows, kv_heads, queries, length = scores.shape
        width = mask.shape[-2]
        # (rows, kv heads, heads per kv head, width, length): the mask per position.
        scores = scores.reshape(rows, kv_heads, queries // width, width, length)
        mask = mask[:, :, None]
        if mask.dtype == mx.bool_:
            lowest = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
            scores = mx.where(mask, scores, lowest)
        else:
            scores = scores + mask
        scores = scores.reshape(rows, kv_heads, queries, length)
    return mx.softmax(scores, axis=-1, precise=True) @ values


def _heads(x: mx.array, rows: int, width: int, heads: int) -> mx.array:
    """(rows * width, heads * head) as (rows, heads, width, head), as mlx-lm lays them out."""
    return x.reshape(rows, width, heads, -1).transpose(0, 2, 1, 3)


def _linear(x: mx.array, weight_t: mx.array, bias: mx.array | None) -> mx.array:
    # nn.Linear's own arithmetic, on its weight's transpose.
    return x @ weight_t if bias is None else mx.addmm(bias, x, weight_t)


def _projection(proj: Any) -> tuple[mx.array, mx.array | None]:
    """A projection's weight transposed (for ``_linear``) and its bias (None: none)."""
    return proj.weight.T, proj.get("bias")


def _pre_weights(layer: Any) -> tuple[Any, ...]:
    a = layer.self_attn
    norms = (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else (None, None)
    return (
        layer.input_layernorm.weight,
        *_projection(a.q_proj),
        *_projection(a.k_proj),
        *_projection(a.v_proj),
        *norms,
    )


def _post_weights(layer: Any) -> tuple[Any, ...]:
    a, m = layer.self_attn, layer.mlp
    return (
        *_projection(a.o_proj),
        layer.post_attention_layernorm.weight,
        *_projection(m.gate_proj),
        *_projection(m.up_proj),
        *_projection(m.down_proj),
    )


def _compile_layer(model: LanguageModel) -> tuple[Any, Any]:
    """A layer's work before attention (norm, q/k/v, their norms, RoPE, the
    softmax scale) and after it (o_proj, residual, norm, MLP, residual),
    compiled. The traced functions hold the head layout, the norms' eps, the
    scale and the RoPE's layout, not the model (see ``_compile``)."""
    layer0 = model.layers[0]
    attn = layer0.self_attn
    traditional = attn.rope.traditional
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    head_dim = attn.q_proj.weight.shape[0] // heads
    scale = attn.scale
    eps = layer0.input_layernorm.eps
    post_eps = layer0.post_attention_layernorm.eps
    qk_eps = attn.q_norm.eps if hasattr(attn, "q_norm") else 0.0

    def pre(
        x: mx.array,
        cos: mx.array,
        sin: mx.array,
        norm: mx.array,
        wq: mx.array,
        bq: mx.array | None,
        wk: mx.array,
        bk: mx.array | None,
        wv: mx.array,
        bv: mx.array | None,
        q_norm: mx.array | None,
        k_norm: mx.array | None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        rows, width = cos.shape[0], cos.shape[2]
        h = mx.fast.rms_norm(x, norm, eps)
        q = _heads(_linear(h, wq, bq), rows, width, heads)
        k = _heads(_linear(h, wk, bk), rows, width, kv_heads)
        v = _heads(_linear(h, wv, bv), rows, width, kv_heads)
        if q_norm is not None and k_norm is not None:
            q = mx.fast.rms_norm(q, q_norm, qk_eps)
            k = mx.fast.rms_norm(k, k_norm, qk_eps)
        # The fallback scales the rotated query; scaling each rotated element is
        # the same product.
        q = scale * (q * cos + _swap(q, traditional) * sin)
        k = k * cos + _swap(k, traditional) * sin
        return q.reshape(rows, kv_heads, heads // kv_heads * width, head_dim), k, v

    def post(
        x: mx.array,
        attended: mx.array,
        wo: mx.array,
        bo: mx.array | None,
        norm: mx.array,
        wg: mx.array,
        bg: mx.array | None,
        wu: mx.array,
        bu: mx.array | None,
        wd: mx.array,
        bd: mx.array | None,
    ) -> mx.array:
        rows, _, _, dim = attended.shape
        # Back to (rows * width, heads * head), as mlx-lm's attention hands it to o_proj.
        attended = attended.reshape(rows, heads, -1, dim).transpose(0, 2, 1, 3)
        h = x + _linear(attended.reshape(x.shape[0], -1), wo, bo)
        r = mx.fast.rms_norm(h, norm, post_eps)
        return h + _linear(nn.silu(_linear(r, wg, bg)) * _linear(r, wu, bu), wd, bd)

    return mx.compile(pre), mx.compile(post)


@dataclass(frozen=True, slots=True)
class CompiledSteps:
    """The compiled steps a runner decodes with: a lone sequence's and the batch's
    (None: that one runs eagerly)."""

    solo: CompiledDecode | None = None
    batch: CompiledBatchStep | None = None

    @classmethod
    def for_model(cls, model: Any, strategy: ExecutionStrategy) -> CompiledSteps:
        """Those ``model`` qualifies for, when ``strategy`` compiles."""
        if not strategy.compiled:
            return cls()
        return cls(CompiledDecode.for_model(model), CompiledBatchStep.for_model(model))
