"""Draft-model speculative decoding: a small model with the target's tokenizer
proposes each row's next tokens. MLX thread only.

The proposer keeps its own batched KV cache with one row per drafting request
of the decode batch, in step with the tokens the request committed: each step
it first feeds what the row committed since (its accepted drafts and new
token), then drafts ``n`` tokens one position at a time, every row in one
forward per position. Rows are fed position by position, so rows that lag by
different amounts never see padding between their tokens. After verification
each row's cache keeps exactly what the row kept (row_layout.py: the cache is cut
to the longest, and shorter rows turn their rejected positions into padding).

A new row first prefills its history (prompt and output so far) in its own
cache, one chunk per step, and joins the batched cache when done: until then
it does not draft. Drafts of a sampling row are drawn from the draft model's
distribution under the row's own sampler (temperature and filters), and that
distribution goes to the verification (speculative.py: ``min(1, p/q)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from omlx.engine.compiled_batch import CompiledBatchStep
from omlx.engine.row_layout import settle_rows
from omlx.mlx_types import (
    BatchCacheLayer,
    CacheLayer,
    LanguageModel,
    int_rows,
    prompt_cache,
)

__all__ = ["DraftModel", "DraftProposer", "Drafts", "plain_kv_model"]


def plain_kv_model(model: LanguageModel) -> bool:
    """Whether every layer of ``model``'s cache is a plain KV cache (the only
    kind a batched cache can cut back after a rejection)."""
    return all(type(layer).__name__ == "KVCache" for layer in prompt_cache(model))


@dataclass(frozen=True, slots=True)
class Drafts:
    """One step's proposals, per decode row: tokens, and for sampling rows the
    (tokens, vocab) logits they were drawn from (None: greedy or no drafts)."""

    tokens: list[list[int]]
    logits: list[mx.array | None]


@dataclass(slots=True)
class _Prefilling:
    """A row filling its own cache before it joins the batch."""

    cache: list[CacheLayer]
    seen: int = 0


@dataclass(frozen=True, slots=True)
class _Fed:
    """What the last drafting forwards fed, to cut the cache back after verification."""

    ids: list[str]
    unseen: list[int]  # committed tokens fed per row
    fed_drafts: list[int]  # drafts fed per row (the last one of a row is never fed)
    positions: int  # positions fed per row


@dataclass(frozen=True, slots=True)
class DraftModel:
    """A draft model as a runner holds it: the model, the target's logit rows and the
    draft's proven compiled batch step (None: its forwards run eager)."""

    model: LanguageModel
    target_vocab: int
    compiled: CompiledBatchStep | None = None

    def proposer(self, chunk_tokens: int) -> DraftProposer:
        """A fresh proposer for a new decode batch."""
        return DraftProposer(self.model, self.target_vocab, chunk_tokens, compiled=self.compiled)


class DraftProposer:
    """The draft model's state for one decode batch (see the module docstring).

    ``target_vocab``: the target's logit rows, the vocabulary of ``q``;
    ``chunk_tokens``: the most positions a row's catch-up feeds per step;
    ``compiled``: the draft's proven compiled batch step (None: its forwards run eager)."""

    def __init__(
        self,
        model: LanguageModel,
        target_vocab: int,
        chunk_tokens: int,
        *,
        compiled: CompiledBatchStep | None = None,
    ):
        self.model = model
        self._compiled = compiled
        self._vocab = target_vocab
        self._chunk = max(chunk_tokens, 1)
        self._cache: list[BatchCacheLayer] = []
        self._ids: list[str] = []
        self._seen: list[int] = []  # tokens of each row's history in the cache
        self._prefilling: dict[str, _Prefilling] = {}
        self._fed: _Fed | None = None

    def drop(self, request_ids: set[str]) -> None:
        """Rows that left the decode batch."""
        for rid in request_ids:
            self._prefilling.pop(rid, None)
        keep = [i for i, rid in enumerate(self._ids) if rid not in request_ids]
        if len(keep) == len(self._ids):
            return
        if not keep:
            self._cache, self._ids, self._seen = [], [], []
            return
        for layer in self._cache:
            layer.filter(keep)
        self._ids = [self._ids[i] for i in keep]
        self._seen = [self._seen[i] for i in keep]

    def planned_positions(self, rows: Sequence[Any], budget: int) -> list[tuple[str, int, int]]:
        """(row, positions, context) the next step's draft forwards may feed per
        row (an upper bound, for the memory gate)."""
        out = []
        for row in rows:
            if row.drafter is None:
                continue
            history = len(row.drafter.tokens)
            if row.request_id in self._ids:
                seen = self._seen[self._ids.index(row.request_id)]
                out.append((row.request_id, min(history - seen, self._chunk) + budget, history))
            else:
                out.append((row.request_id, min(history, self._chunk), history))
        return out

    def propose(self, rows: Sequence[Any], budgets: Sequence[int]) -> Drafts:
        """Up to ``budgets[i]`` drafts for decode row ``i`` (rows without a
        drafter, or still prefilling, draft nothing)."""
        self._fed = None
        by_id = {row.request_id: row for row in rows if row.drafter is not None}
        self.drop({rid for rid in [*self._ids, *self._prefilling] if rid not in by_id})
        self._prefill_new(by_id)
        none = Drafts([[] for _ in rows], [None for _ in rows])
        if not self._ids or not any(budgets):
            return none
        members = [by_id[rid] for rid in self._ids]
        histories = [row.drafter.tokens for row in members]
        if not self._catch_up(histories):
            return none
        budget_of = {row.request_id: n for row, n in zip(rows, budgets, strict=True)}
        tokens, logits = self._draft(members, histories, [budget_of[rid] for rid in self._ids])
        index = {rid: i for i, rid in enumerate(self._ids)}
        picked = [index.get(row.request_id) for row in rows]
        return Drafts(
            [tokens[i] if i is not None else [] for i in picked],
            [logits[i] if i is not None else None for i in picked],
        )

    def commit(self, accepted: dict[str, int]) -> None:
        """Keep what each row kept of the last drafting forwards
        (``accepted``: drafts kept per request)."""
        fed, self._fed = self._fed, None
        if fed is None or fed.ids != self._ids:
            return
        valid = [
            unseen + min(accepted.get(rid, 0), drafts)
            for rid, unseen, drafts in zip(fed.ids, fed.unseen, fed.fed_drafts, strict=True)
        ]
        if fed.positions > max(valid):
            for layer in self._cache:
                layer.trim(fed.positions - max(valid))
        settle_rows(self._cache, valid)
        self._seen = [seen + n for seen, n in zip(self._seen, valid, strict=True)]

    def _prefill_new(self, by_id: dict[str, Any]) -> None:
        """One chunk of each new row's history (all but its last token); rows
        done join the batched cache."""
        for rid in by_id:
            if rid not in self._ids and rid not in self._prefilling:
                self._prefilling[rid] = _Prefilling(prompt_cache(self.model))
        done = []
        for rid, state in self._prefilling.items():
            history = by_id[rid].drafter.tokens
            n = min(self._chunk, len(history) - 1 - state.seen)
            if n > 0:
                self.model(mx.array([history[state.seen : state.seen + n]]), cache=state.cache)
                state.seen += n
            if state.seen == len(history) - 1 and state.seen > 0:
                done.append(rid)
        if done:
            self._join(done, [self._prefilling.pop(rid) for rid in done])

    def _join(self, ids: list[str], states: list[_Prefilling]) -> None:
        """Rows done prefilling join the batched cache (one merge, one extend)."""
        layers = zip(*(state.cache for state in states), strict=True)
        batched = [BatchKVCache.merge(list(per_row)) for per_row in layers]
        if not self._cache:
            self._cache = batched
        else:
            for mine, theirs in zip(self._cache, batched, strict=True):
                mine.extend(theirs)
        self._ids += ids
        self._seen += [state.seen for state in states]

    def _catch_up(self, histories: list[list[int]]) -> bool:
        """Feed the committed tokens every row has unseen but its last, in one
        forward (a chunk at most); False when rows still lag after it."""
        common = min(len(h) - s for h, s in zip(histories, self._seen, strict=True)) - 1
        width = min(common, self._chunk)
        if width > 0:
            feed = mx.array([h[s : s + width] for h, s in zip(histories, self._seen, strict=True)])
            if self._compiled is None or self._compiled.verify(feed, self._cache) is None:
                self.model(feed, cache=self._cache)
            self._seen = [s + width for s in self._seen]
        return common <= self._chunk

    def _draft(
        self, rows: list[Any], histories: list[list[int]], budgets: list[int]
    ) -> tuple[list[list[int]], list[mx.array | None]]:
        """Feed each row's unseen tokens then its own drafts, one position per
        forward (all rows at once); lazy until the one ``eval`` at the end."""
        unseen = [len(h) - s for h, s in zip(histories, self._seen, strict=True)]
        positions = max(u + n - 1 for u, n in zip(unseen, budgets, strict=True))
        # The position whose logits give a row's first draft (the last unseen token's).
        first = [u - 1 for u in unseen]
        scaled: list[list[mx.array]] = [[] for _ in rows]
        columns: list[mx.array] = []  # each forward's pick per row
        # Per row: the history, where its unseen tokens start, how many there are.
        fed = [(h, s, u) for h, s, u in zip(histories, self._seen, unseen, strict=True)]
        for t in range(positions):
            feed = mx.array([h[s + t] if t < u else 0 for h, s, u in fed])
            if columns:
                feed = mx.where(mx.array([t >= u for u in unseen]), columns[-1], feed)
            logits = self._fit_vocab(self._forward(feed))
            drafting = [0 <= t - f < n for f, n in zip(first, budgets, strict=True)]
            columns.append(_pick(rows, logits, drafting, scaled).astype(feed.dtype))
        dists = [mx.concatenate(s) if s else None for s in scaled]
        mx.eval(*columns, *[d for d in dists if d is not None])
        table = int_rows(mx.stack(columns, axis=1)) if columns else [[] for _ in rows]
        tokens = [table[b][f : f + n] for b, (f, n) in enumerate(zip(first, budgets, strict=True))]
        fed_drafts = [max(0, min(n, positions - u)) for u, n in zip(unseen, budgets, strict=True)]
        self._fed = _Fed(list(self._ids), unseen, fed_drafts, positions)
        return tokens, dists

    def _forward(self, feed: mx.array) -> mx.array:
        """The logits (rows, vocab) after one token per row (compiled when proven)."""
        if self._compiled is not None:
            logits = self._compiled(feed, self._cache, prove=False)
            if logits is not None:
                return logits
        eager: mx.array = self.model(feed[:, None], cache=self._cache)[:, -1, :]
        return eager

    def _fit_vocab(self, logits: mx.array) -> mx.array:
        """The draft's logits over the target's vocabulary (extra rows cut, missing
        ones never drawn)."""
        rows = logits.shape[-1]
        if rows == self._vocab:
            return logits
        if rows > self._vocab:
            return logits[:, : self._vocab]
        pad = mx.full((logits.shape[0], self._vocab - rows), -mx.inf, dtype=logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)


def _pick(
    rows: list[Any], logits: mx.array, drafting: list[bool], scaled: list[list[mx.array]]
) -> mx.array:
    """One forward's next token per row: the argmax, or for a sampling row that
    drafts here a draw under its own sampler (whose logits go to ``scaled``)."""
    picks = mx.argmax(logits, axis=-1)
    sampled = [b for b, row in enumerate(rows) if drafting[b] and not row.greedy]
    if not sampled:
        return picks
    column = [picks[b : b + 1] for b in range(len(rows))]
    for b in sampled:
        sampler = rows[b].sampler
        dist = sampler.scaled(logits[b : b + 1])
        scaled[b].append(dist)
        column[b] = mx.random.categorical(dist, key=sampler.next_key()).astype(picks.dtype)
    return mx.concatenate(column)
