"""Typed views of the MLX-side objects the engine handles: mlx-lm's models and
cache layers (whose classes are mostly unannotated), and typed readers of
``mx.array`` values (mlx's stubs type ``item()`` as int | float | complex and
``tolist()`` as a nested union). Pure: MLX is imported for type checking only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn


class CacheLayer(Protocol):
    """One layer of a sequence's cache (mlx-lm's KVCache, RotatingKVCache,
    ArraysCache ...): what every kind has."""

    @property
    def state(self) -> Any: ...  # the layer's arrays (a list or tuple, by kind)

    def is_trimmable(self) -> bool: ...

    def size(self) -> int: ...  # tokens held (a batch's: its longest row's, padding in)

    def trim(self, n: int) -> int: ...


class BatchCacheLayer(CacheLayer, Protocol):
    """One layer of a batch's cache (mlx-lm's BatchKVCache, BatchRotatingKVCache,
    ArraysCache with rows): rows leave, join and come out as one sequence's layer."""

    def filter(self, batch_indices: Any) -> None: ...

    def extend(self, other: Any) -> None: ...

    def extract(self, idx: int) -> Any: ...


class LanguageModel(Protocol):
    """An mlx-lm model (or an mlx-vlm model's language model): tokens (rows,
    positions) through the cache to logits (rows, positions, vocabulary)."""

    def __call__(
        self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None
    ) -> mx.array: ...

    @property
    def layers(self) -> Sequence[Any]: ...


def item_int(x: mx.array) -> int:
    """``int(x.item())`` of a one-element integer array."""
    return int(cast("int | float", x.item()))


def item_float(x: mx.array) -> float:
    """``x.item()`` of a one-element floating array."""
    return cast(float, x.item())


def int_list(x: mx.array) -> list[int]:
    """``x.tolist()`` of a 1-D integer array."""
    return cast("list[int]", x.tolist())


def int_rows(x: mx.array) -> list[list[int]]:
    """``x.tolist()`` of a 2-D integer array."""
    return cast("list[list[int]]", x.tolist())


def float_list(x: mx.array) -> list[float]:
    """``x.tolist()`` of a 1-D floating array."""
    return cast("list[float]", x.tolist())


def float_rows(x: mx.array) -> list[list[float]]:
    """``x.tolist()`` of a 2-D floating array."""
    return cast("list[list[float]]", x.tolist())


def bool_list(x: mx.array) -> list[bool]:
    """``x.tolist()`` of a 1-D boolean array."""
    return cast("list[bool]", x.tolist())


def flat_parameters(module: Any) -> list[tuple[str, mx.array]]:
    """``tree_flatten(module.parameters())``: (dotted name, array) pairs (mlx types
    the result as a list or a dict, by its ``destination`` argument)."""
    from mlx.utils import tree_flatten  # deferred: this module imports no MLX

    return cast("list[tuple[str, mx.array]]", tree_flatten(module.parameters()))


def prompt_cache(model: LanguageModel) -> list[CacheLayer]:
    """mlx-lm's ``make_prompt_cache(model)``: a new, empty cache for one sequence."""
    from mlx_lm.models.cache import make_prompt_cache  # deferred: this module imports no MLX

    # mlx-lm types the model as nn.Module, which declares no __call__ or layers.
    return make_prompt_cache(cast("nn.Module", model))
