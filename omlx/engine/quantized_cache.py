"""A quantized KV cache that batches (issue 41, KV quantization). MLX thread only.

mlx-lm quantizes a sequence's KV with ``QuantizedKVCache`` (``mx.quantize`` as tokens
arrive; its attention runs ``mx.quantized_matmul`` on them, picked by the cache's
``bits``: mlx_lm/models/base.py) but has no batched form. ``BatchQuantizedKVCache``
is mlx-lm's ``BatchKVCache`` (left padding, ``prepare``/``finalize`` for right-padded
prefill chunks, ``merge``/``extend``/``extract``/``filter``) over quantized buffers:
each of keys and values is the (data, scales, biases) triple ``mx.quantize`` makes,
every part holding the sequence on axis 2. ``QuantizedLayer`` is mlx-lm's
``QuantizedKVCache`` that can join a batch (``merge``), as a ``KVCache`` can.

A token's K/V vector is quantized on its own (groups run along the head dimension),
so a row's quantized values are the same alone or batched.

A sequence's first forward attends in full precision, as mlx-lm's own generate does
with ``kv_bits`` (``quantized_kv_start=0``): it runs that forward on a plain
``KVCache`` and quantizes the cache after it (``maybe_quantize_kv_cache``). Our layers
store the first forward's K/V quantized at once (the same values ``to_quantized``
makes) but hand that forward its K/V as computed, and hide ``bits`` from its
attention (mlx-lm's ``scaled_dot_product_attention`` picks the quantized kernel by
``hasattr(cache, "bits")``). Quantizing a prompt's own attention as well drifted
further from full-precision KV and from mlx-lm (benchmarks/README.md, "KV quantization").

``install(model, spec)`` makes the model's caches quantized (mlx-lm's
``make_prompt_cache`` asks ``model.make_cache``), so every cache made for it (a
request's, the prefix template, the load-time measurements) is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, dynamic_roll

from omlx.errors import SettingsError
from omlx.mlx_types import int_list
from omlx.models.model_settings import KVQuantSpec

log = logging.getLogger(__name__)

Triple = tuple[mx.array, mx.array, mx.array]

# Buffers grow by this many tokens, as mlx-lm's caches do.
_STEP = 256


class _FirstForwardPlain:
    """``bits`` as mlx-lm's attention sees it: absent once, right after the update
    that filled an empty cache (that forward attends in full precision), then there.
    The one read that follows an update is the attention's ``hasattr``."""

    _bits: int
    _fresh: bool = False

    @property
    def bits(self) -> int:
        if self._fresh:
            self._fresh = False
            raise AttributeError("bits")  # hasattr(cache, "bits") is False: plain SDPA
        return self._bits

    @bits.setter
    def bits(self, value: int) -> None:
        self._bits = value


class QuantizedLayer(_FirstForwardPlain, QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` that merges into a ``BatchQuantizedKVCache``,
    its first forward attending in full precision (the module's docstring). Its
    state is a ``QuantizedKVCache``'s: the prefix cache stores it as one (kv_codec)."""

    stores_as = QuantizedKVCache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        first = self.keys is None
        self._fresh = False
        fetched: tuple[Any, Any] = super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
        if not first:
            return fetched
        self._fresh = True
        return keys, values

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.group_size, self._bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.group_size, self._bits = v

    def size(self) -> int:
        return int(self.offset)

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


def _empty(shape: tuple[int, ...], like: Triple) -> Triple:
    """Zeroed buffers shaped ``shape`` (batch, heads, tokens) for triples like ``like``."""
    return tuple(mx.zeros((*shape, x.shape[-1]), dtype=x.dtype) for x in like)  # type: ignore[return-value]


class BatchQuantizedKVCache(_FirstForwardPlain):
    """mlx-lm's ``BatchKVCache`` (read it for the padding rules) with quantized K/V,
    its first forward attending in full precision (the module's docstring).
    ``offset``: per row, tokens held (negative while only padding is);
    ``left_padding``: per row, the padding columns before its first token."""

    def __init__(self, left_padding: list[int], group_size: int, bits: int):
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self.group_size = group_size
        self.bits = bits
        self._idx = 0
        self._right_padding: mx.array | None = None

    def _quantize(self, x: mx.array) -> Triple:
        return mx.quantize(x, group_size=self.group_size, bits=self._bits)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        first = self.keys is None
        self._fresh = False
        fetched = self._store(keys, values)
        if not first:
            return fetched
        self._fresh = True
        return keys, values

    def _store(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        prev, num = self._idx, keys.shape[2]
        q_keys, q_values = self._quantize(keys), self._quantize(values)
        if self.keys is None or self.values is None or prev + num > self.keys[0].shape[2]:
            self._grow(q_keys, q_values, num)
        assert self.keys is not None and self.values is not None
        self.offset = self.offset + num
        self._idx += num
        for mine, new in ((self.keys, q_keys), (self.values, q_values)):
            for part, x in zip(mine, new, strict=True):
                part[..., prev : self._idx, :] = x
        return self.keys_and_values()

    def _grow(self, q_keys: Triple, q_values: Triple, num: int) -> None:
        batch, heads = q_keys[0].shape[:2]
        shape = (batch, heads, (_STEP + num - 1) // _STEP * _STEP)
        if self.keys is None or self.values is None:
            self.keys, self.values = _empty(shape, q_keys), _empty(shape, q_values)
            return
        kept = tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))
        grown = (_empty(shape, q_keys), _empty(shape, q_values))
        self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b], axis=2), kept, grown)

    def keys_and_values(self) -> tuple[Triple, Triple]:
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))  # type: ignore[no-any-return]

    def prepare(
        self,
        *,
        left_padding: list[int] | None = None,
        lengths: list[int] | None = None,
        right_padding: list[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty batch cache")
            padding = mx.array(left_padding)
            self.left_padding = self.left_padding + padding
            self.offset = self.offset - padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """Right padding of the last prefill chunk moved to the left (as mlx-lm's)."""
        padding = self._right_padding
        if padding is None:
            return
        self.keys, self.values = tree_map(
            lambda x: dynamic_roll(x, padding[:, None], axis=2), (self.keys, self.values)
        )
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        mask: mx.array = create_causal_mask(
            n, offset=self._idx, left_padding=self.left_padding, **kwargs
        )
        return mask

    def filter(self, batch_indices: Any) -> None:
        """Keep the rows ``batch_indices`` (in that order); shared left padding goes."""
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(int_list(self.left_padding))
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(
                    lambda x: x[..., shift:, :], (self.keys, self.values)
                )
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows, both right-justified to the longer one."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        like = self if self.keys is not None else other
        assert like.keys is not None and like.values is not None
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        parts = [c._justified(idx, size, like.keys, like.values) for c in (self, other)]
        self.keys, self.values = tree_map(
            lambda a, b: mx.concatenate([a, b]), parts[0][0], parts[1][0]
        )
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([parts[0][1], parts[1][1]])
        self._idx = idx

    def _justified(
        self, idx: int, size: int, like_k: Triple, like_v: Triple
    ) -> tuple[tuple[Triple, Triple], mx.array]:
        """This cache's buffers padded to ``size`` columns, its tokens ending at ``idx``."""
        rows, heads = self.offset.shape[0], like_k[0].shape[1]
        kv = (_empty((rows, heads, 0), like_k), _empty((rows, heads, 0), like_v))
        if self.keys is not None and self.values is not None:
            kv = self.keys, self.values
        left = idx - self._idx
        right = size - kv[0][0].shape[2] - left
        if right < 0:
            kv = tree_map(lambda x: x[..., :right, :], kv)
            right = 0
        if left or right:
            kv = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), kv)
        return kv, self.left_padding + left

    def extract(self, idx: int) -> QuantizedLayer:
        """Row ``idx`` as a one-sequence cache (a copy, its padding dropped)."""
        layer = QuantizedLayer(group_size=self.group_size, bits=self._bits)
        padding = int_list(self.left_padding)[idx]
        layer.keys, layer.values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]),
            (self.keys, self.values),
        )
        layer.offset = self._idx - padding
        return layer

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """One-sequence quantized caches as a batch, left-padded to the longest."""
        first = caches[0]
        lengths = [int(c.offset) for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], first.group_size, first._bits)
        filled = [c for c in caches if c.keys is not None]
        if longest == 0 or not filled:
            return batch
        heads = max(c.keys[0].shape[1] for c in filled)
        shape = (len(caches), heads, longest)
        keys, values = _empty(shape, filled[0].keys), _empty(shape, filled[0].values)
        for i, (c, n) in enumerate(zip(caches, lengths, strict=True)):
            if c.keys is None:
                continue
            for mine, theirs in ((keys, c.keys), (values, c.values)):
                for part, x in zip(mine, theirs, strict=True):
                    part[i : i + 1, :, longest - n :] = x[..., :n, :]
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def joins_batch(layers: list[Any]) -> bool:
    """Whether a one-sequence cache can move into the batch as it is: plain KV layers,
    or quantized ones (the batch's layers are then quantized too)."""
    return all(type(layer) in (KVCache, QuantizedLayer) for layer in layers)


def quantized_cache_factory(model: Any, spec: KVQuantSpec) -> Callable[[], list[Any]]:
    """A ``make_cache`` for ``model`` whose plain KV layers are quantized (other
    kinds, such as rotating windows or SSM states, stay as the model makes them)."""
    own = getattr(model, "make_cache", None)

    def make_cache() -> list[Any]:
        layers = own() if own is not None else [KVCache() for _ in model.layers]
        return [
            QuantizedLayer(group_size=spec.group_size, bits=spec.bits)
            if type(layer) is KVCache
            else layer
            for layer in layers
        ]

    return make_cache


def install(model: Any, spec: KVQuantSpec, name: str) -> None:
    """Every cache made for ``model`` from now on quantizes its plain KV layers.
    mlx-lm's own hook (``make_prompt_cache`` defers to ``model.make_cache``): every
    path that makes a cache for the model goes through it. Raises ``SettingsError``
    when the model's head dimension does not split into ``spec``'s groups, or its
    forward cannot attend over quantized K/V (e.g. gemma4's KV-shared layers, which
    take an earlier layer's K/V as plain arrays)."""
    make_cache = quantized_cache_factory(model, spec)
    try:
        # Two forwards: the first attends in full precision, the second over the
        # quantized K/V, which is where such a model fails.
        cache = make_cache()
        mx.eval(model(mx.array([[1, 2]]), cache=cache))
        mx.eval(model(mx.array([[3]]), cache=cache))
    except Exception as exc:  # the model's forward: any error is the setting's
        raise _refused(name, spec, exc) from None
    model.make_cache = make_cache


def _refused(name: str, spec: KVQuantSpec, exc: Exception) -> SettingsError:
    if "group size" in str(exc):  # mx.quantize: the head dimension is not a multiple
        return SettingsError(
            f"kv_group_size: {spec.group_size} does not divide the head dimension of "
            f"{name} ({exc}); set kv_group_size to 32, 64 or 128 as the model allows, "
            "or clear kv_bits",
            param="kv_group_size",
        )
    return SettingsError(
        f"kv_bits: {name} cannot run with a quantized KV cache ({type(exc).__name__}: "
        f"{exc}); clear its kv_bits",
        param="kv_bits",
    )
