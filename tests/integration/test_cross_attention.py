"""mllama's cross-attention states in a batch (models/cross_attention.py): each row's
states follow it through merge, extend, filter and extract as the decode batch moves
rows, and a cross layer over rows with other images, or none, gives each row what
mlx-vlm's own layer gives it alone."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_vlm.models.mllama.config import TextConfig
from mlx_vlm.models.mllama.language import MllamaCrossAttentionDecoderLayer

from omlx.models.cross_attention import CrossAttentionStates, cross_rows

HIDDEN = 32


def _row(num_states: int, seed: int) -> CrossAttentionStates:
    """A sequence's cache: ``num_states`` random image states (0: no image)."""
    row = CrossAttentionStates()
    if num_states:
        row.hold(mx.random.normal((1, num_states, HIDDEN), key=mx.random.key(seed)))
    return row


def _same_row(got: CrossAttentionStates, want: CrossAttentionStates) -> bool:
    if got.num_states != want.num_states:
        return False
    if want.states is None:
        return got.states is None
    return got.states is not None and bool(mx.array_equal(got.states, want.states))


def test_each_row_keeps_its_own_states_as_the_batch_moves_rows() -> None:
    rows = [_row(3, 1), _row(0, 2), _row(5, 3)]
    batch = CrossAttentionStates.merge(rows)
    assert batch.num_states == [3, 0, 5] and batch.batch_size == 3
    # Only the rows with images hold states, padded to the most.
    assert batch.states is not None and batch.states.shape == (2, 5, HIDDEN)
    assert all(_same_row(batch.extract(i), rows[i]) for i in range(3))

    batch.extend(CrossAttentionStates.merge([_row(0, 4), _row(4, 5)]))
    assert batch.num_states == [3, 0, 5, 0, 4]
    assert _same_row(batch.extract(4), _row(4, 5))

    batch.filter([4, 1, 0])
    assert batch.num_states == [4, 0, 3]
    assert batch.states is not None and batch.states.shape == (2, 4, HIDDEN)
    assert _same_row(batch.extract(0), _row(4, 5)) and _same_row(batch.extract(2), rows[0])

    batch.filter([1])
    assert batch.num_states == [0] and batch.states is None


def _layer() -> MllamaCrossAttentionDecoderLayer:
    config = TextConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        cross_attention_layers=[0],
    )
    mx.random.seed(7)
    layer = MllamaCrossAttentionDecoderLayer(config, 0)
    # Open gates (a fresh layer's are tanh(0) = 0: its output would be its input).
    layer.cross_attn_attn_gate = mx.array([0.7])
    layer.cross_attn_mlp_gate = mx.array([-0.4])
    return layer


@pytest.mark.parametrize("tokens", [1, 4])
def test_a_cross_layer_gives_every_row_of_a_mixed_batch_its_result_alone(tokens: int) -> None:
    layer = _layer()
    rows = [_row(3, 1), _row(0, 2), _row(5, 3), _row(0, 4)]
    h = mx.random.normal((len(rows), tokens, HIDDEN), key=mx.random.key(9))
    together = cross_rows(layer, h, CrossAttentionStates.merge(rows))
    for i, row in enumerate(rows):
        # mlx-vlm's layer on the row alone: its states with no mask, or its text-only path.
        alone = layer(h[i : i + 1], cross_attention_states=row.states, cache=row)
        assert mx.allclose(together[i : i + 1], alone, atol=1e-5), i


def test_a_text_row_of_a_right_padded_chunk_attends_its_own_tokens_only() -> None:
    layer = _layer()
    batch = CrossAttentionStates.merge([_row(0, 1), _row(0, 2)])
    h = mx.random.normal((2, 5, HIDDEN), key=mx.random.key(9))
    batch.prepare(lengths=[5, 3])  # as mlx-lm's batched prefill marks a padded chunk
    together = cross_rows(layer, h, batch)
    alone = layer(h[1:, :3], cross_attention_states=None, cache=_row(0, 2))
    assert mx.allclose(together[1:, :3], alone, atol=1e-5)
    assert mx.allclose(together[:1], layer(h[:1], cross_attention_states=None), atol=1e-5)
