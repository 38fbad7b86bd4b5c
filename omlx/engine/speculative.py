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
  step's own draw, the same for a seed with or without drafts.

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
    rows: Sequence[Any], logits: mx.array, seqs: Sequence[Sequence[int]], starts: Sequence[int]
) -> list[Verdict]:
    """Each row's verdict from the step's logits (rows, width, vocab). Greedy
    rows without processors share one argmax; the others are judged one by one."""
    plain = [
        e
        for e, row in enumerate(rows)
        if row.greedy and not row.processors and row.logprobs is None
    ]
    picks = {}
    if plain:
        # Every row plain (the usual greedy batch): no gather, one argmax, one sync.
        picked = logits if len(plain) == len(rows) else logits[mx.array(plain)]
        picks = dict(zip(plain, mx.argmax(picked, axis=-1).tolist(), strict=True))
    verdicts = []
    for e, (row, seq, start) in enumerate(zip(rows, seqs, starts, strict=True)):
        drafts = seq[start + 1 :]
        if e in picks:
            verdicts.append(verify_greedy(picks[e], seq, start))
        elif row.processors:
            verdicts.append(verify_processed(row, logits[e], seq, start, row.context))
        elif drafts:
            verdicts.append(verify_sampled(row.sampler, logits[e, start:], drafts))
        else:
            verdicts.append(verify_plain(row, logits[e], start))
    return verdicts


def verify_greedy(argmax: list[int], seq: Sequence[int], start: int) -> Verdict:
    """Greedy, no processors: ``argmax[j]`` is the model's pick after ``seq[: j + 1]``."""
    j = start
    while j + 1 < len(seq) and argmax[j] == seq[j + 1]:
        j += 1
    return Verdict(j - start, argmax[j])


def verify_sampled(sampler: Any, logits: mx.array, drafts: Sequence[int]) -> Verdict:
    """``drafts`` judged against ``logits`` (m + 1, V), position ``j`` holding the
    distribution ``drafts[j]`` stands in for: each position is drawn exactly as
    the plain step would draw it there (its key, its categorical), and a draft is
    kept while it equals the draw. Kept with probability p(d), rejection
    sampling's rate for a point-mass draft, and every token handed out is the
    plain step's own draw: a seed gives the same tokens with or without drafts,
    and a preempted request resumes with them (one key per token either way)."""
    m = len(drafts)
    keys = sampler.keys_ahead(m + 1)
    draws = [sampler.draw(logits[j : j + 1], key) for j, key in enumerate(keys)]
    mx.eval(draws)
    tokens = [int(d.item()) for d in draws]
    kept = 0
    while kept < m and tokens[kept] == drafts[kept]:
        kept += 1
    sampler.advance(kept + 1)
    return Verdict(kept, tokens[kept])


def verify_processed(
    row: Any, logits: mx.array, seq: Sequence[int], start: int, context: mx.array | None
) -> Verdict:
    """A row with logits processors: position by position from ``start``, each
    position's logits processed with the context up to it, then judged."""
    j = start
    while True:
        fed = mx.array(list(seq[: j + 1]))
        ctx = fed if context is None else mx.concatenate([context, fed])
        one = logits[j : j + 1]
        for processor in row.processors:
            one = processor(ctx, one)
        # Drawn as the plain step draws here (greedy: the argmax); a draft is kept
        # while it equals the draw.
        token = int(row.sampler(one).item())
        if j + 1 == len(seq) or token != seq[j + 1]:
            return Verdict(j - start, token, _logprobs(row, one, token))
        j += 1


def verify_plain(row: Any, logits: mx.array, start: int) -> Verdict:
    """A row without drafts or processors: its own sampler at its last position."""
    one = logits[start : start + 1]
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

    def add(self, drafts: Sequence[Sequence[int]], verdicts: Sequence[Verdict]) -> None:
        self.steps += 1
        self.row_steps += len(verdicts)
        self.drafted += sum(len(d) for d in drafts)
        accepted = sum(v.num_accepted for v in verdicts)
        self.accepted += accepted
        self.tokens += accepted + len(verdicts)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
