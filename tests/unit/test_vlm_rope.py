"""models/vlm_rope.py on mlx-vlm's own SuScaledRoPE: a batch's rows roped as each alone
(tests/api/test_vision_longrope.py checks the served answers)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from omlx.models.vlm_rope import TokenSuScaledRoPE, rope_each_token

THRESHOLD = 48
DIMS = 8


def longrope() -> nn.Module:
    """mlx-vlm's LongRoPE as phi4mm's decoder builds it (initialize_rope, "longrope")."""
    from mlx_vlm.models.rope_utils import initialize_rope

    short = [1.0 + i / 4 for i in range(DIMS // 2)]
    scaling = {"type": "longrope", "short_factor": short, "long_factor": short[::-1]}
    return initialize_rope(
        DIMS,
        base=10000.0,
        traditional=False,
        scaling_config=scaling,
        max_position_embeddings=4 * THRESHOLD,
        original_max_position_embeddings=THRESHOLD,
    )


def test_each_row_of_a_batch_is_roped_as_mlx_vlm_ropes_it_alone() -> None:
    theirs = longrope()
    ours = TokenSuScaledRoPE(theirs)
    offsets = [10, THRESHOLD - 1, THRESHOLD, 90]  # decode steps either side of it
    x = mx.random.normal((len(offsets), 2, 1, DIMS + 4), key=mx.random.key(0))
    batched = ours(x, offset=mx.array(offsets))
    for row, offset in enumerate(offsets):
        alone = theirs(x[row : row + 1], offset=offset)
        assert mx.array_equal(batched[row : row + 1], alone)
        assert mx.array_equal(ours(x[row : row + 1], offset=offset), alone)
    # The premise: mlx-vlm's own ropes the batch's short rows by the long factors.
    assert not mx.array_equal(theirs(x, offset=mx.array(offsets))[0], batched[0])


def test_a_forward_across_the_threshold_ropes_each_token_by_its_position() -> None:
    theirs = longrope()
    ours = TokenSuScaledRoPE(theirs)
    x = mx.random.normal((1, 2, 12, DIMS), key=mx.random.key(1))
    start = THRESHOLD - 5
    across = ours(x, offset=start)
    before = theirs(x[:, :, :5], offset=start)  # mlx-vlm's chunks ending on the threshold
    after = theirs(x[:, :, 5:], offset=THRESHOLD)
    assert mx.array_equal(across, mx.concatenate([before, after], axis=2))
    assert mx.array_equal(ours(x, offset=mx.array([start])), across)


def test_every_longrope_of_a_language_model_is_replaced() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rope = longrope()
            self.plain = nn.RoPE(DIMS)

    model = nn.Module()
    model.layers = [Attention(), Attention()]
    assert rope_each_token(model) == 2
    assert all(isinstance(layer.rope, TokenSuScaledRoPE) for layer in model.layers)
    assert all(isinstance(layer.plain, nn.RoPE) for layer in model.layers)
    # No parameters: the factors stay out of the weights, as in mlx-vlm's module.
    assert tree_flatten(model.parameters()) == []
