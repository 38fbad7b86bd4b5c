"""The texts that ship with oQ (calibration, held-out) and perplexity on them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources

import mlx.core as mx
import mlx.nn as nn

from omlx.mlx_types import item_float
from omlx.quant.sensitivity import QuantCancelled


def shipped_text(name: str) -> str:
    """``calibration`` or ``heldout``: English prose with some code, written for omlx."""
    return (resources.files("omlx.quant") / "data" / f"{name}.txt").read_text(encoding="utf-8")


def token_chunks(tokens: list[int], chunk_tokens: int, max_tokens: int) -> list[mx.array]:
    """The first ``max_tokens`` tokens cut into (1, n) arrays of at most ``chunk_tokens``."""
    tokens = tokens[:max_tokens]
    return [
        mx.array(tokens[i : i + chunk_tokens])[None]
        for i in range(0, len(tokens), chunk_tokens)
        if len(tokens[i : i + chunk_tokens]) > 1
    ]


def calibration_batches(tokens: list[int], chunk_tokens: int, max_tokens: int) -> list[mx.array]:
    """The calibration tokens as one (n, chunk_tokens) batch of full chunks (a ragged
    tail dropped), so each layer is quantized for measuring once, not once per chunk."""
    chunks = token_chunks(tokens, chunk_tokens, max_tokens)
    full = [c for c in chunks if c.shape[1] == chunk_tokens]
    return [mx.concatenate(full, axis=0)] if full else chunks


def perplexity(
    model: nn.Module,
    chunks: list[mx.array],
    on_progress: Callable[[float], None] = lambda _f: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """exp(mean next-token cross entropy) over every chunk (each chunk on its own)."""
    total_loss, num_tokens = 0.0, 0
    for i, chunk in enumerate(chunks):
        if should_stop():
            raise QuantCancelled
        logits = model(chunk[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, chunk[:, 1:], reduction="sum")
        total_loss += item_float(loss)
        num_tokens += chunk.shape[1] - 1
        on_progress((i + 1) / len(chunks))
    if num_tokens == 0:
        raise ValueError("the evaluation text has fewer than two tokens")
    return math.exp(total_loss / num_tokens)


@contextmanager
def fake_quantized(model: nn.Module, bits: dict[str, int], group_size: int) -> Iterator[None]:
    """Within the block, each layer in ``bits`` holds its weight after a quantize /
    dequantize round trip at that width: the values a quantized model computes with."""
    from mlx.utils import tree_flatten

    from omlx.quant.sensitivity import qdq

    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    originals = {path: modules[path].weight for path in bits}
    try:
        for path, b in bits.items():
            modules[path].weight = qdq(originals[path], b, group_size)
            mx.eval(modules[path].weight)
        yield
    finally:
        for path, weight in originals.items():
            modules[path].weight = weight
