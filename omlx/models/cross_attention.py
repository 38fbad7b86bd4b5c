"""mllama's cross-attention layers in the shared decode batch. MLX thread only.

mlx-vlm's mllama language model gives every cross-attention layer one array of
image states for the whole forward, and a forward without states takes the
layers' text-only path (their queries attend a split of themselves, over the
forward's tokens, with no mask). A batch holds rows with other images, or none:
here each row keeps its own states in the layer's cache (padded to the batch's
most, with a key mask), and each cross layer runs once for the rows with images
and once for the rows without, so every row computes what mlx-vlm computes for
it alone. Prefill of an image prompt (one row, with the prompt's masks) still
goes through mlx-vlm's own forward.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


class CrossAttentionStates(ArraysCache):
    """The cache of a cross-attention layer (mllama): the image states of the rows
    that have images (those rows, most image tokens, hidden; in row order, each
    zero-padded past its own; None while no row has any) and how many are each
    row's own (``num_states``: 0 for a row without images, which takes mlx-vlm's
    text-only path and holds nothing). Held in the cache, they travel with the
    sequence into the decode batch and out of it. ``offset`` 0: mlx-vlm's layer
    reads it, and takes its text-only path when a prompt has no image."""

    offset = 0

    def __init__(self, size: int = 1, left_padding: list[int] | None = None):
        super().__init__(size, left_padding)
        self.num_states: list[int] = [0] * max(len(left_padding or ()), 1)

    @property
    def states(self) -> mx.array | None:
        return self.cache[0]

    def hold(self, states: mx.array) -> None:
        """One row's states (1, image tokens, hidden), from its prompt's embedding."""
        self[0] = states
        self.num_states = [int(states.shape[1])]

    @classmethod
    def merge(cls, caches: list[Any]) -> CrossAttentionStates:
        merged = cls()
        merged.num_states = [n for c in caches for n in c.num_states]
        merged[0] = _stacked([c.states for c in caches])
        return merged

    def extend(self, other: Any) -> None:
        self[0] = _stacked([self.states, other.states])
        self.num_states = self.num_states + other.num_states
        self.lengths = None

    def filter(self, batch_indices: Any) -> None:
        """Keep ``batch_indices``' rows. Their states are gathered into a new array
        (the memory gate prices that copy: ``leave_copy_states``), unless every row
        with images stays: a row without leaving keeps the array as it is."""
        keep = [int(i) for i in batch_indices]
        kept = [self._image_rank(i) for i in keep if self.num_states[i]]
        every = len(kept) == len(self.image_rows())
        self.num_states = [self.num_states[i] for i in keep]
        states = self.states
        if states is not None and kept and not (every and kept == sorted(kept)):
            states = states[mx.array(kept), : max(self.num_states)]
        self[0] = states if kept else None
        self.left_padding = None
        self.lengths = self.lengths[mx.array(keep)] if self.lengths is not None else None

    def extract(self, idx: int) -> CrossAttentionStates:
        row = CrossAttentionStates()
        n = self.num_states[idx]
        if n and self.states is not None:
            rank = self._image_rank(idx)
            row[0] = self.states[rank : rank + 1, :n]
        row.num_states = [n]
        return row

    @property
    def batch_size(self) -> int:
        return len(self.num_states)

    def image_rows(self) -> list[int]:
        """The rows with images, in the order their states are held."""
        return [i for i, n in enumerate(self.num_states) if n]

    def _image_rank(self, row: int) -> int:
        """Where ``row``'s states lie among the held ones."""
        return sum(1 for n in self.num_states[:row] if n)


def _stacked(parts: list[mx.array | None]) -> mx.array | None:
    """The held states of several caches, one after another, each zero-padded to
    the most image tokens of any (None: none holds any)."""
    held = [s for s in parts if s is not None]
    if not held:
        return None
    most = max(int(s.shape[1]) for s in held)
    padded = [
        s if s.shape[1] == most else mx.pad(s, [(0, 0), (0, most - s.shape[1]), (0, 0)])
        for s in held
    ]
    return padded[0] if len(padded) == 1 else mx.concatenate(padded)


def batched_forward(
    language_model: Any,
    inputs: mx.array,
    cache: list[Any],
    cross_layers: tuple[int, ...],
    input_embeddings: mx.array | None = None,
) -> mx.array:
    """mlx-vlm's mllama forward without the prompt's masks (a text prefill chunk,
    a decode step), every cross layer per row (``cross_rows``): logits."""
    from mlx_vlm.models.base import create_attention_mask  # deferred: heavy import

    text = language_model.model
    h = input_embeddings if input_embeddings is not None else text.embed_tokens(inputs)
    mask = create_attention_mask(h, cache)
    # The first cross layer's cache holds the rows' states for all of them.
    held = cache[cross_layers[0]]
    for i, (layer, layer_cache) in enumerate(zip(text.layers, cache, strict=True)):
        if i in cross_layers:
            h = cross_rows(layer, h, held)
        else:
            h = self_attention_rows(layer, h, mask, layer_cache)
    logits: mx.array = language_model.lm_head(text.norm(h))
    return logits


def self_attention_rows(layer: Any, h: mx.array, mask: Any, cache: Any) -> mx.array:
    """mlx-vlm's mllama self-attention layer, its rope at each row's own offset:
    mlx-vlm's takes the batch cache's shared timeline (padding included), which
    shifts a left-padded row's positions (a lone sequence's offset is the same)."""
    from mlx_vlm.models.base import scaled_dot_product_attention  # deferred: heavy import

    attn = layer.self_attn
    x = layer.input_layernorm(h)
    rows, length, _ = x.shape

    def heads(proj: Any, n: int) -> mx.array:
        out: mx.array = proj(x).reshape(rows, length, n, -1).transpose(0, 2, 1, 3)
        return out

    queries = attn.rope(heads(attn.q_proj, attn.num_heads), offset=cache.offset)
    keys = attn.rope(heads(attn.k_proj, attn.num_key_value_heads), offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, heads(attn.v_proj, attn.num_key_value_heads))
    out = scaled_dot_product_attention(queries, keys, values, cache, scale=attn.scale, mask=mask)
    h = h + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(rows, length, -1))
    result: mx.array = h + layer.mlp(layer.post_attention_layernorm(h))
    return result


def cross_rows(layer: Any, h: mx.array, held: CrossAttentionStates) -> mx.array:
    """One mllama cross layer over a batch: the rows with images attend their own
    states (their padding masked out; mlx-vlm's decode passes no mask), the rows
    without take the text-only path over their own tokens of the forward (a
    right-padded prefill chunk's padding masked out)."""
    images = held.image_rows()
    texts = [i for i, n in enumerate(held.num_states) if not n]
    if not texts:
        return _with_images(layer, h, held)
    if not images:
        return _text_only(layer, h, held, texts)
    with_images = _with_images(layer, h[mx.array(images)], held)
    out = mx.concatenate([with_images, _text_only(layer, h[mx.array(texts)], held, texts)])
    order = sorted(range(len(images) + len(texts)), key=(images + texts).__getitem__)
    return out[mx.array(order)]


def _with_images(layer: Any, h: mx.array, held: CrossAttentionStates) -> mx.array:
    counts = [n for n in held.num_states if n]
    assert held.states is not None
    mask = None
    if min(counts) < max(counts):
        mask = (mx.arange(max(counts))[None] < mx.array(counts)[:, None])[:, None, None]
    out: mx.array = layer(h, cross_attention_states=held.states, attention_mask=mask, cache=None)
    return out


def _text_only(layer: Any, h: mx.array, held: CrossAttentionStates, rows: list[int]) -> mx.array:
    mask = None
    if held.lengths is not None:
        lengths = held.lengths[mx.array(rows)]
        mask = (mx.arange(h.shape[1])[None] < lengths[:, None])[:, None, None]
    out: mx.array = layer(h, cross_attention_states=None, attention_mask=mask, cache=None)
    return out
