"""LongRoPE (mlx-vlm's SuScaledRoPE) by each token's own position. MLX thread only.

mlx-vlm's SuScaledRoPE (phi3_v's decoder; phi4mm's and any ``longrope`` config through
its initialize_rope) takes its short or long factors for a whole forward from the
forward's largest position: ``max(offset) + length > original_max_position_embeddings``.
In omlx's decode batch a row short of that point, beside a row past it, would be roped
by the long factors, where alone (mlx-vlm's generate) it takes the short ones, and its
answer would drift. ``TokenSuScaledRoPE`` ropes each token by its own position: the
short factors before ``original_max_position_embeddings``, the long ones from there.
That is mlx-vlm's generate alone: its decode steps are one token, and its prefill
chunks of DEFAULT_PREFILL_STEP_SIZE (2048) end on the checkpoints' 4096. And a token's
KV then depends on its position only, never on which rows or which chunk it was
prefilled with, so batch rows, prefill chunks and prefix-cache hits all agree.
(mlx-lm's text SuScaledRoPE always takes the long factors: text phi3 has no choice.)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class TokenSuScaledRoPE(nn.Module):
    """mlx-vlm's SuScaledRoPE, its factors chosen per token, not per forward."""

    def __init__(self, rope: Any):
        super().__init__()
        self.dim = int(rope.dim)
        self.original_max_position_embeddings = int(rope.original_max_position_embeddings)
        # mlx-vlm keeps each side's factors and scale only as these arrays (underscored:
        # not parameters, as in mlx-vlm's module).
        self._short_freqs = rope._short_freqs
        self._short_scale = rope._short_scale
        self._long_freqs = rope._long_freqs
        self._long_scale = rope._long_scale

    def _rope(self, x: mx.array, offset: int | mx.array, long: bool) -> mx.array:
        """mlx-vlm's SuScaledRoPE.__call__ with one side's factors and scale."""
        freqs = self._long_freqs if long else self._short_freqs
        scale = self._long_scale if long else self._short_scale
        x_rope = scale.astype(x.dtype) * x[..., : self.dim]
        if self.dim < x.shape[-1]:
            x = mx.concatenate([x_rope, x[..., self.dim :]], axis=-1)
        else:
            x = x_rope
        return mx.fast.rope(
            x, self.dim, traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs
        )

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        """``x``: (rows, heads, tokens, dims); ``offset``: the position of the forward's
        first token, an int or (a batch) each row's."""
        length, threshold = x.shape[-2], self.original_max_position_embeddings
        if not isinstance(offset, mx.array):
            # One row (a solo forward): every token on one side needs one rope.
            if offset + length <= threshold:
                return self._rope(x, offset, long=False)
            if offset >= threshold:
                return self._rope(x, offset, long=True)
        positions = mx.array(offset, dtype=mx.int32).reshape(-1, 1) + mx.arange(length)
        past = (positions >= threshold)[:, None, :, None]
        return mx.where(past, self._rope(x, offset, long=True), self._rope(x, offset, long=False))


def rope_each_token(language_model: nn.Module) -> int:
    """Replace every mlx-vlm SuScaledRoPE in ``language_model`` by a TokenSuScaledRoPE
    of the same factors; the number replaced."""
    from mlx_vlm.models.rope_utils import SuScaledRoPE  # deferred: mlx-vlm is heavy

    replaced = 0
    for _, module in language_model.named_modules():
        for key, child in list(module.items()):
            if isinstance(child, SuScaledRoPE):
                module[key] = TokenSuScaledRoPE(child)
                replaced += 1
    return replaced
