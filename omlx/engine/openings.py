"""A burst's shared openings, run: requests starting together whose prompts open
with the same tokens prefill that opening once (the scheduler plans which:
scheduler/openings.py). MLX thread only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from omlx.cache.prefix import CacheHit
from omlx.mlx_types import CacheLayer, LanguageModel, prompt_cache
from omlx.scheduler import Request
from omlx.scheduler.openings import SharedOpening


def share_openings(
    model: LanguageModel,
    openings: Sequence[SharedOpening],
    started: Sequence[Request],
    hits: Mapping[str, CacheHit | None],
) -> dict[str, tuple[int, list[CacheLayer]]]:
    """Prefill each planned opening once (the scheduler planned and gated them:
    scheduler/openings.py) and give each of its requests a copy of the result.
    An opening runs for the requests that started (a fork waits for its leader)
    from the shortest of their actual hits; it is skipped when fewer than two
    remain, or a hit came back shorter than planned (a damaged SSD block): its
    requests then prefill it in their own chunks. Returns (tokens cached, cache)
    per request that shares; for models that ``shares_openings``."""
    by_id = {r.request_id: r for r in started}
    out: dict[str, tuple[int, list[CacheLayer]]] = {}
    for opening in openings:
        group = [by_id[rid] for rid in opening.request_ids if rid in by_id]
        cached = {r.request_id: _hit_length(hits[r.request_id]) for r in group}
        start = min(cached.values(), default=0)
        if len(group) < 2 or not opening.start <= start < opening.end:
            continue
        base = hits[min(group, key=lambda r: cached[r.request_id]).request_id]
        # A copy of the hit's first ``start`` tokens: the forward appends to it.
        cache = (
            cast("list[KVCache]", prompt_cache(model))  # shares_openings: plain KV layers
            if base is None
            else [_kv_prefix(layer, start) for layer in base.layers]
        )
        model(mx.array(group[0].prompt_ids[start : opening.end])[None], cache=cache)
        mx.eval([layer.state for layer in cache])
        for r in group:
            if cached[r.request_id] < opening.end:
                out[r.request_id] = (
                    opening.end,
                    [_kv_prefix(layer, opening.end) for layer in cache],
                )
    return out


def shares_openings(model: LanguageModel) -> bool:
    """Whether requests of ``model`` can start from a copy of a shared opening's
    cache (plain KV layers only: rotating or state-space caches cannot be sliced)."""
    return all(type(layer) is KVCache for layer in prompt_cache(model))


def _kv_prefix(layer: KVCache, n: int) -> KVCache:
    """A cache holding the first ``n`` tokens of ``layer`` (views: the batch the
    request joins copies them into its own arrays)."""
    out = KVCache()
    assert layer.keys is not None and layer.values is not None
    out.keys, out.values = layer.keys[..., :n, :], layer.values[..., :n, :]
    out.offset = n
    return out


def _hit_length(hit: CacheHit | None) -> int:
    return 0 if hit is None else hit.num_tokens
