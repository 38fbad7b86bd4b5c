"""Verifying drafted tokens: which of a row's guesses the model keeps, and the
token after them. MLX thread only.

A speculative step feeds each row its pending tokens (committed, not yet in the
cache: at least the last sampled one) followed by its drafts, in one forward of
width ``W``; the logits at position ``j`` are the model's next-token
distribution after ``seq[: j + 1]``. Walking from the last pending position, a
draft is kept while the model agrees with it, and the first disagreement (or
the position after the last draft) gives one more token, sampled as the
non-speculative step would have sampled it there. So a step hands out between
one and ``drafts + 1`` tokens per row, and the output follows the model's own
distribution:

- greedy: a draft is kept when it is the argmax (token-for-token the
  non-speculative output);
- sampling: each position is drawn as the plain step draws it (the request's
  next key, its categorical) and a draft is kept while it equals the draw, so
  draft ``d`` is kept with probability ``p(d)`` (rejection sampling's rate for
  a point-mass draft) and every token follows ``p`` exactly: it is the plain
  step's own draw, the same for a seed with or without drafts;
- sampling with a draft model's distribution ``q`` (speculative sampling):
  ``d`` is kept with probability ``min(1, p(d) / q(d))``; otherwise the token
  is drawn from ``normalize(max(0, p - q))``: again exactly ``p`` (in
  distribution: a seed's tokens differ from the plain step's).

Logits processors (repetition penalty, the grammar mask) run on each judged
position in order, with the context up to it, and only up to the position that
decides the step: a grammar matcher never accepts a token that is not kept, so
nothing needs rolling back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from omlx.engine.logprobs import pending_logprobs
from omlx.mlx_types import bool_list, int_rows, item_int
from omlx.scheduler import TokenLogprob


@dataclass(frozen=True, slots=True)
class Verdict:
    """One row's outcome: the drafts kept and the token sampled after them."""

    num_accepted: int
    token: int
    logprobs: TokenLogprob | None = None


def draft_dist_logits(sampler: Any, logits: mx.array) -> mx.array | None:
    """The logits a sampling row's sampler draws from (filters and temperature
    applied; softmax of them is its distribution), or None for greedy rows."""
    scaled = getattr(sampler, "scaled", None)
    return None if scaled is None else scaled(logits)


def verify_rows(
    rows: Sequence[Any],
    logits: mx.array,
    seqs: Sequence[Sequence[int]],
) -> list[Verdict]:
    """Each row's verdict from the step's logits (rows, width, vocab). Greedy
    rows without processors share one argmax; the others are judged one by one.
    A row's ``draft_logits``: the logits a draft model drew its drafts from (one
    row per draft, softmax is ``q``), or None for point-mass drafts (n-gram)."""
    plain = [
        e
        for e, row in enumerate(rows)
        if row.greedy and not row.processors and row.logprobs is None
    ]
    picks = {}
    if plain:
        # Every row plain (the usual greedy batch): no gather, one argmax, one sync.
        picked = logits if len(plain) == len(rows) else logits[mx.array(plain)]
        picks = dict(zip(plain, int_rows(mx.argmax(picked, axis=-1)), strict=True))
    verdicts = []
    for e, (row, seq) in enumerate(zip(rows, seqs, strict=True)):
        drafts = seq[1:]
        q = getattr(row, "draft_logits", None)
        if e in picks:
            verdicts.append(verify_greedy(picks[e], seq))
        elif row.processors:
            verdicts.append(verify_processed(row, logits[e], seq, row.context, q))
        elif drafts:
            verdicts.append(verify_sampled(row.sampler, logits[e], drafts, q))
        else:
            verdicts.append(verify_plain(row, logits[e]))
    return verdicts


def verify_greedy(argmax: list[int], seq: Sequence[int]) -> Verdict:
    """Greedy, no processors: ``argmax[j]`` is the model's pick after ``seq[: j + 1]``."""
    j = 0
    while j + 1 < len(seq) and argmax[j] == seq[j + 1]:
        j += 1
    return Verdict(j, argmax[j])


def verify_sampled(
    sampler: Any, logits: mx.array, drafts: Sequence[int], q: mx.array | None = None
) -> Verdict:
    """``drafts`` judged against ``logits`` (m + 1, V), position ``j`` holding the
    distribution ``drafts[j]`` stands in for: each position is drawn exactly as
    the plain step would draw it there (its key, its categorical), and a draft is
    kept while it equals the draw. Kept with probability p(d), rejection
    sampling's rate for a point-mass draft, and every token handed out is the
    plain step's own draw: a seed gives the same tokens with or without drafts,
    and a preempted request resumes with them (one key per token either way).
    ``q`` (m, V): a draft model's logits the drafts were drawn from (then
    ``verify_drafted``)."""
    m = len(drafts)
    if q is not None and m:
        return verify_drafted(sampler, logits, drafts, q)
    keys = sampler.keys_ahead(m + 1)
    draws = [sampler.draw(logits[j : j + 1], key) for j, key in enumerate(keys)]
    mx.eval(draws)
    tokens = [int(d.item()) for d in draws]
    kept = 0
    while kept < m and tokens[kept] == drafts[kept]:
        kept += 1
    sampler.advance(kept + 1)
    return Verdict(kept, tokens[kept])


def verify_drafted(sampler: Any, logits: mx.array, drafts: Sequence[int], q: mx.array) -> Verdict:
    """Speculative sampling: ``drafts[j]`` was drawn from softmax(``q[j]``);
    kept with probability min(1, p/q), else the token comes from max(0, p - q)
    renormalised; after all m kept, one more from ``p`` at position m."""
    m = len(drafts)
    scaled = sampler.scaled(logits)
    k_accept, k_residual, k_bonus = mx.random.split(sampler.next_key(), 3)
    p = mx.softmax(scaled.astype(mx.float32), axis=-1)
    qp = mx.softmax(q.astype(mx.float32), axis=-1)
    d = mx.array(list(drafts))[:, None]
    p_draft = mx.take_along_axis(p[:m], d, axis=-1)[:, 0]
    q_draft = mx.take_along_axis(qp, d, axis=-1)[:, 0]
    uniform = mx.random.uniform(shape=(m,), key=k_accept)
    residual = mx.maximum(p[:m] - qp, 0.0)
    # p == q leaves nothing: then the draft was kept for sure (the fallback is unused).
    empty = residual.sum(axis=-1, keepdims=True) <= 0
    residual_logits = mx.where(empty, scaled[:m], mx.log(residual))
    resampled = mx.random.categorical(residual_logits, key=k_residual)
    bonus = mx.random.categorical(scaled[m:], key=k_bonus)
    mx.eval(p_draft, q_draft, uniform, resampled, bonus)
    kept = bool_list(uniform * q_draft < p_draft)
    for j, ok in enumerate(kept):
        if not ok:
            return Verdict(j, item_int(resampled[j]))
    return Verdict(m, item_int(bonus))


def verify_processed(
    row: Any,
    logits: mx.array,
    seq: Sequence[int],
    context: mx.array | None,
    q: mx.array | None = None,
) -> Verdict:
    """A row with logits processors: position by position, each position's
    logits processed with the context up to it, then judged (``q``: the draft
    model's logits per draft, see ``verify_sampled``)."""
    j = 0
    while True:
        fed = mx.array(list(seq[: j + 1]))
        ctx = fed if context is None else mx.concatenate([context, fed])
        one = logits[j : j + 1]
        for processor in row.processors:
            one = processor(ctx, one)
        if q is not None and not row.greedy and j + 1 < len(seq):
            # A draft model's draft: speculative sampling against its q.
            q_j = q[j : j + 1]
            verdict = verify_drafted(row.sampler, mx.concatenate([one, one]), [seq[j + 1]], q_j)
            if not verdict.num_accepted:
                return Verdict(j, verdict.token, _logprobs(row, one, verdict.token))
            j += 1
            continue
        # Drawn as the plain step draws here (greedy: the argmax); a draft is kept
        # while it equals the draw.
        token = int(row.sampler(one).item())
        if j + 1 == len(seq) or token != seq[j + 1]:
            return Verdict(j, token, _logprobs(row, one, token))
        j += 1


def verify_plain(row: Any, logits: mx.array) -> Verdict:
    """A row without drafts or processors: its own sampler at its position."""
    one = logits[0:1]
    token = int(row.sampler(one).item())
    return Verdict(0, token, _logprobs(row, one, token))


def _logprobs(row: Any, logits: mx.array, token: int) -> TokenLogprob | None:
    """The token's logprobs, for rows that asked (they never draft: one position)."""
    if row.logprobs is None:
        return None
    pending = pending_logprobs(logits, mx.array([token]), row.logprobs)
    return pending.to_python([token], [row.logprobs])[0]


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding counters of one decode batch (for /metrics)."""

    steps: int = 0  # speculative steps run
    row_steps: int = 0  # rows advanced by them
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of them kept
    tokens: int = 0  # tokens handed out by them (kept drafts + one per row)
    # Steps decoded without drafts because rows joined (or left) after the memory
    # gate passed the step's speculation plan: the next plan gates them.
    unplanned_steps: int = 0

    def add(self, drafts: Sequence[Sequence[int]], verdicts: Sequence[Verdict]) -> None:
        self.steps += 1
        self.row_steps += len(verdicts)
        self.drafted += sum(len(d) for d in drafts)
        accepted = sum(v.num_accepted for v in verdicts)
        self.accepted += accepted
        self.tokens += accepted + len(verdicts)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
