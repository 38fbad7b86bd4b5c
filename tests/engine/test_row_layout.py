"""Rows of a speculative batch that accept different numbers of tokens keep exactly
their own tokens in the shared cache (no re-feeding): the next forward of each
row equals a solo forward over that row's tokens, and a row taken out of the
batch (for the prefix cache, preemption or a fork) has its tokens in fed order."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from omlx.engine import row_layout
from omlx.engine.row_layout import RowLayouts

WIDTH = 4  # positions each speculative forward verifies per row


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def model(request, tiny_models_dir: Path):
    return load(str(tiny_models_dir / request.param))[0]


def solo(model, tokens: list[int]) -> tuple[mx.array, list]:
    """The last position's logits and the cache of one plain forward of ``tokens``."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)[0, -1]
    mx.eval(logits, [c.state for c in cache])
    return logits, cache


def batch_of(model, prompts: list[list[int]]) -> list[BatchKVCache]:
    caches = [solo(model, p)[1] for p in prompts]
    return [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]


def uneven_steps(model, cache, layouts, histories, rng: random.Random, steps: int) -> None:
    """Speculative steps: WIDTH random tokens per row, each row keeping a random
    1..WIDTH of them (the cache trimmed to the longest, then settled)."""
    for _ in range(steps):
        fed = [[rng.randrange(1, 400) for _ in range(WIDTH)] for _ in histories]
        mx.eval(model(mx.array(fed), cache=cache))
        valid = [rng.randint(1, WIDTH) for _ in histories]
        for layer in cache:
            layer.trim(WIDTH - max(valid))
        layouts.settle(cache, valid)
        for history, tokens, n in zip(histories, fed, valid, strict=True):
            history += tokens[:n]


def assert_rows_match_solo(model, cache, layouts, histories) -> None:
    nxt = [[7 + i] for i in range(len(histories))]
    logits = model(mx.array(nxt), cache=cache)[:, -1]
    for i, history in enumerate(histories):
        want, solo_cache = solo(model, history + nxt[i])
        assert mx.allclose(logits[i], want, atol=1e-4, rtol=1e-4).item(), f"row {i}"
        mine = layouts.in_order(i, [layer.extract(i) for layer in cache])
        for got, ref in zip(mine, solo_cache, strict=True):
            assert got.offset == ref.offset == len(history) + 1
            assert mx.allclose(got.keys, ref.keys[..., : ref.offset, :], atol=1e-4).item()
            assert mx.allclose(got.values, ref.values[..., : ref.offset, :], atol=1e-4).item()
        history += nxt[i]


def test_rows_keep_what_they_accepted_and_come_out_in_order(model, monkeypatch) -> None:
    monkeypatch.setattr(row_layout, "SHARED_PADDING_DROP", 6)
    rng = random.Random(3)
    histories = [[rng.randrange(1, 400) for _ in range(n)] for n in (9, 14, 5)]
    cache = batch_of(model, histories)
    layouts = RowLayouts()
    layouts.join(len(histories))
    uneven_steps(model, cache, layouts, histories, rng, steps=10)
    assert_rows_match_solo(model, cache, layouts, histories)
    # Shared padding is dropped: the cache is no longer than its longest row plus
    # what the drop has not reached yet.
    longest = max(len(h) for h in histories)
    assert cache[0]._idx < longest + row_layout.SHARED_PADDING_DROP
    # A row leaves (the batch filters it out); the others go on, and come out right.
    for layer in cache:
        layer.filter([0, 2])
    layouts.keep([0, 2])
    histories = [histories[0], histories[2]]
    uneven_steps(model, cache, layouts, histories, rng, steps=6)
    assert_rows_match_solo(model, cache, layouts, histories)


def test_a_new_row_joins_a_batch_whose_rows_were_moved(model) -> None:
    rng = random.Random(5)
    histories = [[rng.randrange(1, 400) for _ in range(n)] for n in (11, 6)]
    cache = batch_of(model, histories)
    layouts = RowLayouts()
    layouts.join(2)
    uneven_steps(model, cache, layouts, histories, rng, steps=5)
    joining = [rng.randrange(1, 400) for _ in range(8)]
    for mine, theirs in zip(cache, batch_of(model, [joining]), strict=True):
        mine.extend(theirs)
    layouts.join(1)
    histories.append(joining)
    uneven_steps(model, cache, layouts, histories, rng, steps=5)
    assert_rows_match_solo(model, cache, layouts, histories)
