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

mlx-lm's generate with ``kv_bits`` runs each forward on a plain ``KVCache`` until,
after a forward, the cache holds ``quantized_kv_start`` tokens or more; then
``maybe_quantize_kv_cache`` replaces it by its ``to_quantized`` copy, and every later
forward attends over quantized K/V. Our layers do the same in place (the model holds
the cache list): they hold full-precision K/V, and the update that leaves them
``start`` tokens or more quantizes them all (the same values ``to_quantized`` makes)
but hands that forward its K/V as computed, and hides ``bits`` from its attention
(mlx-lm's ``scaled_dot_product_attention`` picks the quantized kernel by
``hasattr(cache, "bits")``). ``start`` 0 quantizes after the first forward, which
attends in full precision; quantizing a prompt's own attention as well drifted further
from full-precision KV and from mlx-lm (benchmarks/README.md, "KV quantization").

In a batch one cache holds every row: it quantizes at the forward that leaves its
longest row ``start`` tokens or more (shorter rows then hold fewer), and rows of both
kinds never share it: a batch meeting quantized rows (``merge``, ``extend``) quantizes
its full-precision ones, since quantized K/V cannot be made full precision again.

``install(model, spec)`` makes the model's caches quantized (mlx-lm's
``make_prompt_cache`` asks ``model.make_cache``), so every cache made for it (a
request's, the prefix template, the load-time measurements) is.
"""

from __future__ import annotations

import dataclasses
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

# Buffers grow by this many tokens, as mlx-lm's caches do (its own step).
_STEP: int = QuantizedKVCache.step


class _PlainUntilQuantized:
    """``bits`` as mlx-lm's attention sees it: absent while the layer holds full-precision
    K/V and once more right after the update that quantized it (that forward attends in
    full precision), then there. The one read that follows an update is the attention's
    ``hasattr``. The layer is quantized once its keys are ``mx.quantize``'s triples."""

    _bits: int
    _fresh: bool = False
    keys: Any

    @property
    def quantized(self) -> bool:
        return isinstance(self.keys, tuple)

    @property
    def bits(self) -> int:
        if not self.quantized:
            raise AttributeError("bits")  # hasattr(cache, "bits") is False: plain SDPA
        if self._fresh:
            self._fresh = False
            raise AttributeError("bits")
        return self._bits

    @bits.setter
    def bits(self, value: int) -> None:
        self._bits = value

    @property
    def kv_bits(self) -> int:
        """The bits its K/V is (or will be) quantized to; the codec's layout reads it."""
        return self._bits


class QuantizedLayer(_PlainUntilQuantized, QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` that merges into a ``BatchQuantizedKVCache``, with
    mlx-lm's ``quantized_kv_start``: it holds full-precision K/V (as a ``KVCache``) until
    a forward leaves it ``start`` tokens or more, then quantizes them all (what mlx-lm's
    ``maybe_quantize_kv_cache`` does after that forward with ``to_quantized``) and stays
    quantized. That forward attends in full precision (the module's docstring). Its state
    is a ``QuantizedKVCache``'s: the prefix cache stores it as one (kv_codec), full-precision
    tokens quantized as they are stored (``stored_kv``)."""

    stores_as = QuantizedKVCache

    def __init__(self, group_size: int = 64, bits: int = 8, start: int = 0):
        super().__init__(group_size=group_size, bits=bits)
        self.start = start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._fresh = False
        if self.quantized:
            quantized: tuple[Any, Any] = super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
            return quantized
        fetched: tuple[Any, Any] = KVCache.update_and_fetch(self, keys, values)  # type: ignore[arg-type]
        if self.offset >= self.start:
            stored: tuple[Any, Any] = self.stored_kv(0, self.offset)
            self.keys, self.values = stored
            self._fresh = True
        return fetched

    def keys_and_values(self) -> tuple[Any, Any]:
        if self.quantized:
            return super().keys_and_values()  # type: ignore[no-untyped-call,no-any-return]
        plain: tuple[Any, Any] = KVCache.keys_and_values(self)  # type: ignore[arg-type]
        return plain

    def stored_kv(self, start: int, end: int) -> tuple[Triple, Triple]:
        """Tokens [start, end) as quantized triples (full-precision ones quantized: the
        values ``to_quantized`` makes, each token's vector on its own)."""
        if self.quantized:
            return tree_map(lambda x: x[..., start:end, :], (self.keys, self.values))  # type: ignore[no-any-return]
        return tree_map(  # type: ignore[no-any-return]
            lambda x: _quantize(x[..., start:end, :], self.group_size, self._bits),
            (self.keys, self.values),
        )

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


def _quantize(x: mx.array, group_size: int, bits: int) -> Triple:
    """``x`` as ``mx.quantize``'s (data, scales, biases), a tuple: what marks quantized K/V."""
    data, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return data, scales, biases


def _parts(x: Any) -> tuple[mx.array, ...]:
    """A buffer's arrays: a quantized triple's three, or the one full-precision array."""
    return x if isinstance(x, tuple) else (x,)


def _empty(shape: tuple[int, ...], like: Any) -> Any:
    """Zeroed buffers shaped ``shape`` (batch, heads, tokens) for buffers like ``like``
    (a quantized triple or a full-precision array)."""
    return tree_map(lambda x: mx.zeros((*shape, x.shape[-1]), dtype=x.dtype), like)


class BatchQuantizedKVCache(_PlainUntilQuantized):
    """mlx-lm's ``BatchKVCache`` (read it for the padding rules) with quantized K/V and
    mlx-lm's ``quantized_kv_start`` for the batch: it holds full-precision K/V (as a
    ``BatchKVCache``) until a forward leaves its longest row ``start`` tokens or more,
    then quantizes every row and stays quantized; that forward attends in full
    precision (the module's docstring). Rows that meet mix no kinds: a quantized row
    joining a full-precision batch, or the other way round, quantizes the batch.
    ``offset``: per row, tokens held (negative while only padding is);
    ``left_padding``: per row, the padding columns before its first token."""

    def __init__(self, left_padding: list[int], group_size: int, bits: int, start: int = 0):
        self.keys: Any = None
        self.values: Any = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        # The rows' offsets as Python ints: when to quantize, read without a device sync.
        self._rows = [-p for p in left_padding]
        self.group_size = group_size
        self.bits = bits
        self.start = start
        self._idx = 0
        self._right_padding: mx.array | None = None
        self._right: list[int] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._fresh = False
        fetched = self._store(keys, values)
        if not self.quantized and self._longest() >= self.start:
            self.quantize()
            self._fresh = True
        return fetched

    def _longest(self) -> int:
        """The most tokens a row holds (a last prefill chunk's right padding is none)."""
        right = self._right or [0] * len(self._rows)
        return max((n - p for n, p in zip(self._rows, right, strict=True)), default=0)

    def quantize(self) -> None:
        """Its full-precision K/V quantized from now on (as mlx-lm's ``to_quantized``)."""
        if self.keys is None or self.quantized:
            return
        self.keys, self.values = tree_map(
            lambda x: _quantize(x[..., : self._idx, :], self.group_size, self._bits),
            (self.keys, self.values),
        )

    def _store(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        prev, num = self._idx, keys.shape[2]
        new: tuple[Any, Any] = (keys, values)
        if self.quantized:
            new = tree_map(lambda x: _quantize(x, self.group_size, self._bits), new)
        if self.keys is None or prev + num > _parts(self.keys)[0].shape[2]:
            self._grow(*new, num)
        self.offset = self.offset + num
        self._rows = [n + num for n in self._rows]
        self._idx += num
        for mine, arrived in ((self.keys, new[0]), (self.values, new[1])):
            for part, x in zip(_parts(mine), _parts(arrived), strict=True):
                part[..., prev : self._idx, :] = x
        return self.keys_and_values()

    def _grow(self, like_k: Any, like_v: Any, num: int) -> None:
        batch, heads = _parts(like_k)[0].shape[:2]
        shape = (batch, heads, (_STEP + num - 1) // _STEP * _STEP)
        if self.keys is None or self.values is None:
            self.keys, self.values = _empty(shape, like_k), _empty(shape, like_v)
            return
        kept = tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))
        grown = (_empty(shape, like_k), _empty(shape, like_v))
        self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b], axis=2), kept, grown)

    def keys_and_values(self) -> tuple[Any, Any]:
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
            self._rows = [n - p for n, p in zip(self._rows, left_padding, strict=True)]
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)
            self._right = list(right_padding)

    def finalize(self) -> None:
        """Right padding of the last prefill chunk moved to the left (as mlx-lm's)."""
        padding = self._right_padding
        if padding is None:
            return
        self.keys, self.values = tree_map(
            lambda x: dynamic_roll(x, padding[:, None], axis=2), (self.keys, self.values)
        )
        self.offset = self.offset - padding
        self._rows = [n - p for n, p in zip(self._rows, self._right, strict=True)]
        self.left_padding = self.left_padding + padding
        self._right_padding, self._right = None, []

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self._rows = int_list(self.offset)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        self._rows = [r - n for r in self._rows]
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
        self._rows = int_list(self.offset)
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
        """Append ``other``'s rows, both right-justified to the longer one; a batch of
        full-precision rows meeting quantized ones is quantized first."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            self._rows = self._rows + other._rows
            return
        if self.quantized or other.quantized:
            self.quantize()
            other.quantize()
        like = self if self.keys is not None else other
        idx = max(self._idx, other._idx)
        size = max(_parts(c.keys)[0].shape[2] for c in (self, other) if c.keys is not None)
        parts = [c._justified(idx, size, like.keys, like.values) for c in (self, other)]
        self.keys, self.values = tree_map(
            lambda a, b: mx.concatenate([a, b]), parts[0][0], parts[1][0]
        )
        self.offset = mx.concatenate([self.offset, other.offset])
        self._rows = self._rows + other._rows
        self.left_padding = mx.concatenate([parts[0][1], parts[1][1]])
        self._idx = idx

    def _justified(
        self, idx: int, size: int, like_k: Any, like_v: Any
    ) -> tuple[tuple[Any, Any], mx.array]:
        """This cache's buffers padded to ``size`` columns, its tokens ending at ``idx``."""
        rows, heads = self.offset.shape[0], _parts(like_k)[0].shape[1]
        kv = (_empty((rows, heads, 0), like_k), _empty((rows, heads, 0), like_v))
        if self.keys is not None and self.values is not None:
            kv = self.keys, self.values
        left = idx - self._idx
        right = size - _parts(kv[0])[0].shape[2] - left
        if right < 0:
            kv = tree_map(lambda x: x[..., :right, :], kv)
            right = 0
        if left or right:
            kv = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), kv)
        return kv, self.left_padding + left

    def extract(self, idx: int) -> QuantizedLayer:
        """Row ``idx`` as a one-sequence cache (a copy, its padding dropped)."""
        layer = QuantizedLayer(group_size=self.group_size, bits=self._bits, start=self.start)
        padding = int_list(self.left_padding)[idx]
        layer.keys, layer.values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]),
            (self.keys, self.values),
        )
        layer.offset = self._idx - padding
        return layer

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """One-sequence caches as a batch, left-padded to the longest: quantized if any
        of them is (its full-precision rows quantized as they join)."""
        first = caches[0]
        lengths = [int(c.offset) for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], first.group_size, first._bits, first.start)
        filled = [c for c in caches if c.keys is not None]
        if longest == 0 or not filled:
            return batch
        quantized = any(c.quantized for c in filled)
        rows = [_row_kv(c, n, quantized) for c, n in zip(caches, lengths, strict=True)]
        like = next(kv for kv in rows if kv is not None)
        heads = max(_parts(kv[0])[0].shape[1] for kv in rows if kv is not None)
        shape = (len(caches), heads, longest)
        keys, values = _empty(shape, like[0]), _empty(shape, like[1])
        for i, (kv, n) in enumerate(zip(rows, lengths, strict=True)):
            if kv is None:
                continue
            for mine, theirs in ((keys, kv[0]), (values, kv[1])):
                for part, x in zip(_parts(mine), _parts(theirs), strict=True):
                    part[i : i + 1, :, longest - n :] = x
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._rows = lengths
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
        return sum(x.nbytes for x in (*_parts(self.keys), *_parts(self.values)))


def _row_kv(layer: Any, num: int, quantized: bool) -> tuple[Any, Any] | None:
    """A one-sequence layer's first ``num`` tokens, quantized if ``quantized``."""
    if layer.keys is None:
        return None
    if quantized:
        return layer.stored_kv(0, num)  # type: ignore[no-any-return]
    return tree_map(lambda x: x[..., :num, :], (layer.keys, layer.values))  # type: ignore[no-any-return]


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
            QuantizedLayer(group_size=spec.group_size, bits=spec.bits, start=spec.start)
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
        # quantized K/V, which is where such a model fails (quantized from the first
        # forward on, whatever the model's start: the check must reach the second).
        cache = quantized_cache_factory(model, dataclasses.replace(spec, start=0))()
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
