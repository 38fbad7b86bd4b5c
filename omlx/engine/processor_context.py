"""The tokens a request's logits processors see as its context. MLX thread only."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


def processor_context(ids: Sequence[int]) -> mx.array | None:
    """``ids`` as logits processors take them (mlx-lm's repetition penalty indexes the
    logits by them), less image placeholders: mlx-vlm's negative ids (-200, one a row
    of a fastvlm or llava_bunny image) stand for no token, and would index the logits
    from the end. None when no token is left."""
    kept = [t for t in ids if t >= 0]
    return mx.array(kept) if kept else None
