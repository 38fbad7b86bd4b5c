"""A burst's shared opening: requests starting together whose prompts open with
the same tokens prefill that opening once. MLX thread only."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx.cache.prefix import CacheHit
from omlx.cache.prefix_index import common_prefix
from omlx.scheduler import Request

# Requests starting together share the prefill of their common opening when that
# saves at least this many token-rows of prefill (below, the separate forward costs
# more than it saves).
MIN_SHARED_OPENING = 16

# The memory gate for a shared opening's forward: (tokens, tokens already cached)
# -> may it run now?
OpeningGate = Callable[[int, int], bool]


def share_openings(
    model: Any,
    requests: list[Request],
    hits: dict[str, CacheHit | None],
    step_size: int,
    may_share: OpeningGate | None = None,
) -> dict[str, tuple[int, list[Any]]]:
    """Requests starting together whose prompts open with the same tokens (a
    system prompt, tool definitions, a chat template's preamble, a client's
    fixed opening of each turn): the common opening is prefilled once, up to
    one prefill chunk, and each request starts from a copy of that cache.

    The prefix cache may already hold part of an opening (a burst usually
    shares a cached preamble and goes on with tokens nobody sent before): the
    shared forward starts where the shortest hit among the sharers ends, from
    that hit's cache. Sharers are picked best first (see ``best_share``) and
    share when that saves at least MIN_SHARED_OPENING token-rows of prefill.
    The shared forward is one row of ``n - start`` tokens after ``start``
    cached: ``may_share(n - start, start)`` gates it as the engine gates every
    chunk; refused, the group's requests prefill the opening themselves, in
    their own gated chunks. Returns (tokens cached, cache) per request that
    shares; only for models whose cache is plain KV layers."""
    if len(requests) < 2:
        return {}
    template = make_prompt_cache(model)
    if any(type(layer) is not KVCache for layer in template):
        return {}
    cached = {r.request_id: _hit_length(hits[r.request_id]) for r in requests}
    # Prompts in token order: requests sharing an opening sit next to each other.
    pending = sorted(requests, key=lambda r: r.prompt_ids)
    out: dict[str, tuple[int, list[Any]]] = {}
    while len(pending) >= 2:
        best = best_share(pending, cached, step_size)
        if best is None:
            break
        lo, hi, start, n = best
        group, pending = pending[lo:hi], pending[:lo] + pending[hi:]
        if may_share is not None and not may_share(n - start, start):
            continue
        base = min(group, key=lambda r: cached[r.request_id])
        hit = hits[base.request_id]
        if hit is None:
            opening = make_prompt_cache(model)
        else:
            # A copy of the hit's first ``start`` tokens: the forward appends to it.
            opening = [_kv_prefix(layer, start) for layer in hit.layers]
        model(mx.array(base.prompt_ids[start:n])[None], cache=opening)
        mx.eval([layer.state for layer in opening])
        for r in group:
            if cached[r.request_id] < n:
                out[r.request_id] = (n, [_kv_prefix(layer, n) for layer in opening])
    return out


def best_share(
    ordered: list[Request], cached: dict[str, int], step_size: int
) -> tuple[int, int, int, int] | None:
    """The run ``ordered[lo:hi]`` (prompts in token order) whose shared opening
    saves the most token-rows of prefill: the rows each request would prefill
    itself up to the opening's end ``n``, less the rows prefilled once from
    ``start`` (the shortest hit). Each request keeps at least two tokens of its
    own to prefill. (lo, hi, start, n), or None below MIN_SHARED_OPENING."""
    adjacent = [common_prefix(a.prompt_ids, b.prompt_ids) for a, b in itertools.pairwise(ordered)]
    best, best_saved = None, MIN_SHARED_OPENING - 1
    for lo in range(len(ordered) - 1):
        n_common, start = len(ordered[lo].prompt_ids) - 2, cached[ordered[lo].request_id]
        for hi in range(lo + 2, len(ordered) + 1):
            r = ordered[hi - 1]
            n_common = min(n_common, adjacent[hi - 2], len(r.prompt_ids) - 2)
            start = min(start, cached[r.request_id])
            n = min(n_common, start + step_size)
            if n <= start:
                continue
            group = ordered[lo:hi]
            saved = sum(max(0, n - cached[q.request_id]) for q in group) - (n - start)
            if saved > best_saved:
                best, best_saved = (lo, hi, start, n), saved
    return best


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
