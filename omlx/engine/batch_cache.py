"""mlx-lm's ``BatchKVCache`` through its public API: how many token columns a layer
holds (padding included) and setting them, without its private ``_idx``."""

from __future__ import annotations

from typing import Any


def columns(layer: Any) -> int:
    """Token columns ``layer`` holds: the attention's width, left padding included."""
    return int(layer.size())


def set_columns(layer: Any, num_columns: int) -> None:
    keys, values, offset, left_padding, _ = layer.state
    layer.state = (keys, values, offset, left_padding, num_columns)
