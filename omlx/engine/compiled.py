"""Compiled decode steps: a lone sequence's as one MLX graph (the batch's, layer by
layer, is compiled_batch.py's ``CompiledBatchStep``). MLX thread only.

Eagerly, every decode step rebuilds the model's graph in Python (hundreds of
ops, one at a time) and MLX runs each elementwise op as its own kernel. Traced
once with ``mx.compile``, the step replays without Python and with elementwise
chains fused: faster on the CPU backend, same tokens (benchmarks/README.md,
"Figures behind design choices"; not measured on a GPU here).

A compiled graph needs fixed shapes, so the step runs on the layers' own
``KVCache`` buffers (allocated in steps of 256 tokens, like ``KVCache`` does):
the whole buffer goes in, the write position is an array input, and a mask
hides the columns past it. The buffers stay the caches' own between steps, so
the batch, the prefix cache and the memory accounting see plain ``KVCache``
objects at any time; growing a full buffer is the same concatenation
``KVCache.update_and_fetch`` does. A new buffer size retraces (once per 256
tokens; its cost: benchmarks/README.md, "Figures behind design choices"). On
the CPU backend MLX builds the fused kernels with the system C++ compiler (g++;
once, kept under its temp directory) and runs the traced graph unfused when
there is none.

Qualified: mlx-lm's llama, qwen2 and qwen3 (attention takes the cache's offset
as an array and asks the cache for its mask) with a RoPE that passes an array
offset through, every layer a plain ``KVCache``, one token per step, batch 1.
Anything else decodes eagerly. Before its first step the compiled graph runs
once on a scratch cache and must give the eager forward's logits; if it fails
or disagrees, the model decodes eagerly from then on.
"""

from __future__ import annotations

import logging
from typing import Any, TypeGuard, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

from omlx.mlx_types import CacheLayer, LanguageModel, prompt_cache

log = logging.getLogger(__name__)

# Buffers grow by this many tokens, as KVCache's do (KVCache.step).
GROW = 256
# Traces kept (one per buffer size); past this the compiled function starts over,
# which frees the old traces (a long conversation passes through many sizes).
MAX_TRACES = 8

_MODULES = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"})
# RoPE classes whose __call__ hands the offset straight to mx.fast.rope (an array
# works); DynamicNTKScalingRoPE, for one, does Python arithmetic on it.
_ROPES = (nn.RoPE, Llama3RoPE, SuScaledRoPE, YarnRoPE)


class _Slab:
    """One layer's cache inside the traced step: a fixed-size buffer written at
    an array position. Only ever holds the traced step's placeholders."""

    def __init__(self) -> None:
        self.keys: mx.array
        self.values: mx.array
        self.offset: mx.array

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.offset[None]
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        # Called before the layers write: column j is visible to the new token at
        # position offset when j <= offset (the buffer past it is stale or zero).
        columns = mx.arange(self.keys.shape[2], dtype=mx.int32)
        return (columns <= self.offset)[None, None, None, :]


def qualifies(model: LanguageModel) -> bool:
    """Whether ``model``'s decode step can be compiled here."""
    if type(model).__module__ not in _MODULES:
        return False
    layers = getattr(model, "layers", None)
    if not layers:
        return False
    rope = getattr(getattr(layers[0], "self_attn", None), "rope", None)
    return type(rope) in _ROPES


class CompiledStep:
    """What both compiled steps keep: the shapes traced (past ``max_traces`` the
    compiled functions start over, which frees the old traces), whether the
    one-time proof against the eager forward passed or failed (then the model
    decodes eagerly from then on), and how many steps ran compiled."""

    max_traces: int
    name: str

    def __init__(self, model: LanguageModel):
        self._model = model
        self._sizes: set[Any] = set()  # shapes traced (buffer sizes or token shapes)
        self._proven = False
        self.failed = False
        self.steps = 0  # steps run compiled
        self._compile()

    @property
    def proven(self) -> bool:
        return self._proven

    def prove(self) -> bool:
        """Run the one-time check now (at model load, say) unless it already ran;
        whether the compiled step will be used."""
        if not (self._proven or self.failed):
            self._prove()
        return self._proven

    def _compile(self) -> None:
        raise NotImplementedError

    def _check(self) -> bool:
        """Compiled and eager logits on a scratch cache agree."""
        raise NotImplementedError

    def _cap_traces(self, size: Any) -> None:
        """Before a step of ``size``: start over if a new trace would pass the cap."""
        if size not in self._sizes and len(self._sizes) >= self.max_traces:
            self._compile()
            self._sizes.clear()

    def _prove(self) -> bool:
        try:
            ok = self._check()
            if not ok:
                log.warning("%s disagrees with the eager forward; decoding eagerly", self.name)
        except Exception:
            log.warning("%s unavailable; decoding eagerly", self.name, exc_info=True)
            ok = False
        self._proven, self.failed = ok, not ok
        return ok


class CompiledDecode(CompiledStep):
    """The decode step of one model, traced once per buffer size and replayed
    for every lone sequence of that model."""

    max_traces = MAX_TRACES
    name = "compiled decode"

    def _compile(self) -> None:
        self._step = _compile(self._model)

    @staticmethod
    def for_model(model: LanguageModel) -> CompiledDecode | None:
        return CompiledDecode(model) if qualifies(model) else None

    @staticmethod
    def accepts(cache: list[CacheLayer]) -> TypeGuard[list[KVCache]]:
        """Every layer a plain KVCache holding something (batch 1)."""
        return all(
            type(c) is KVCache and c.keys is not None and c.keys.shape[0] == 1 for c in cache
        )

    def __call__(self, token: mx.array, cache: list[KVCache]) -> mx.array | None:
        """Logits (1, vocab) after feeding one ``token`` (shape (1,)) into
        ``cache``, or None (cache untouched) when the step cannot run compiled."""
        if self.failed or not (self._proven or self._prove()):
            return None
        offset = cache[0].offset
        if any(c.offset != offset for c in cache):
            return None
        buffers = _room_buffers(cache)
        size = buffers[0].shape[2]  # the first layer's keys
        self._cap_traces(size)
        try:  # a new size traces here: an error leaves the cache as it was
            out = self._step(token.reshape(1, 1), mx.array(offset, dtype=mx.int32), *buffers)
        except Exception:
            log.warning("compiled decode failed to trace; decoding eagerly", exc_info=True)
            self.failed = True
            return None
        # Nothing is evaluated before the caches hold the new buffers: by the time
        # the step runs, only its graph holds the old ones, so it writes into them in
        # place (evaluated while they were still held, it would copy them whole).
        self._sizes.add(size)
        self.steps += 1
        for i, c in enumerate(cache):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset += 1
        logits: mx.array = out[0]
        return logits

    def _check(self) -> bool:
        """Run the compiled step once on a two-token scratch cache, evaluated here
        (on the CPU backend the first run builds the fused kernels), and check
        its logits against the eager forward's. Later steps are evaluated lazily,
        in place, on the sequence's own buffers."""
        # A qualifying model's cache: plain KVCache layers.
        compiled = cast("list[KVCache]", prompt_cache(self._model))
        eager = prompt_cache(self._model)
        token = mx.array([2])
        for c in (compiled, eager):
            self._model(mx.array([[0, 1]]), cache=c)
        buffers = _room_buffers(compiled)
        got = self._step(token.reshape(1, 1), mx.array(2, dtype=mx.int32), *buffers)[0]
        want = self._model(token.reshape(1, 1), cache=eager)[:, -1, :]
        self._sizes.add(buffers[0].shape[2])  # the first layer's keys
        return bool(mx.allclose(got, want, rtol=1e-3, atol=1e-3).item())


def _compile(model: LanguageModel) -> Any:
    """The model's decode step, compiled. The traced function holds the model
    but not the decoder: MLX's compiled function cannot take part in Python's
    cycle collection, so a cycle through it would keep the weights alive after
    the model is unloaded."""
    slabs = [_Slab() for _ in model.layers]

    def traced(token: mx.array, offset: mx.array, *buffers: mx.array) -> list[mx.array]:
        for i, slab in enumerate(slabs):
            slab.keys, slab.values, slab.offset = buffers[2 * i], buffers[2 * i + 1], offset
        logits = model(token, cache=slabs)[:, -1, :]
        out = [logits]
        for slab in slabs:
            out += [slab.keys, slab.values]
        return out

    return mx.compile(traced)


def _room_buffers(cache: list[KVCache]) -> list[mx.array]:
    """Each layer's keys and values buffers, with room for one more token."""
    buffers: list[mx.array] = []
    for c in cache:
        buffers += _make_room(c)
    return buffers


def _make_room(cache: KVCache) -> tuple[mx.array, mx.array]:
    """Room for one more token, grown as KVCache grows its buffer; the layer's
    keys and values buffers."""
    assert cache.keys is not None and cache.values is not None
    if cache.offset < cache.keys.shape[2]:
        return cache.keys, cache.values
    live = cache.offset
    steps = (live + GROW) // GROW
    shape_k = (*cache.keys.shape[:2], steps * GROW - live, cache.keys.shape[3])
    shape_v = (*cache.values.shape[:2], steps * GROW - live, cache.values.shape[3])
    cache.keys = mx.concatenate(
        [cache.keys[..., :live, :], mx.zeros(shape_k, cache.keys.dtype)], axis=2
    )
    cache.values = mx.concatenate(
        [cache.values[..., :live, :], mx.zeros(shape_v, cache.values.dtype)], axis=2
    )
    return cache.keys, cache.values


# ---------------------------------------------------------------------------
# The batched decode step: each layer's work before and after attention,
# compiled once per batch size and shared by every layer.
