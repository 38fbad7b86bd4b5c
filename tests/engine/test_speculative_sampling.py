"""Rejection sampling of drafted tokens: the tokens a speculative step hands out
follow the request's own sampling distribution, position by position."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from omlx.engine.sampling import make_request_sampler
from omlx.engine.speculative import verify_processed, verify_sampled
from omlx.scheduler import SamplingParams

VOCAB = 6
N = 3000
# With N draws over 6 outcomes the total variation distance from the true
# distribution stays below ~0.03 (its expectation is ~0.015); a broken
# acceptance rule (always keep the draft, or keep it with p(d) squared) is
# off by more than 0.1 here.
MAX_TV = 0.05

LOGITS = mx.array(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, 1.5],  # position 0: the first token's distribution
        [0.0, 2.5, 0.3, 1.2, 0.9, -0.5],  # position 1: after the first draft
        [1.0, 1.0, 1.0, 0.0, 0.0, 3.0],  # position 2: after both drafts
    ]
)
DRAFTS = [5, 2]  # a likely first guess, an unlikely second one


def target(logits: mx.array, temperature: float, top_k: int = 0) -> np.ndarray:
    """softmax(logits / temperature) over the top-k logits (numpy, independently)."""
    x = np.array(logits, dtype=np.float64) / temperature
    if top_k:
        x[np.argsort(x)[:-top_k]] = -np.inf
    p = np.exp(x - x.max())
    return p / p.sum()


def tv(counts: Counter, p: np.ndarray) -> float:
    total = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / total - p[t]) for t in range(len(p)))


def first_two(verdicts) -> tuple[Counter, Counter]:
    """The first handed-out token of each verdict, and the second where the first
    draft was kept (the only case the step hands out a second one)."""
    first, second = Counter(), Counter()
    for v in verdicts:
        if v.num_accepted == 0:
            first[v.token] += 1
            continue
        first[DRAFTS[0]] += 1
        second[DRAFTS[1] if v.num_accepted == 2 else v.token] += 1
    return first, second


def test_kept_and_resampled_tokens_follow_the_sampling_distribution() -> None:
    params = SamplingParams(temperature=0.8, seed=7)
    sampler = make_request_sampler(params)
    verdicts = [verify_sampled(sampler, LOGITS, DRAFTS) for _ in range(N)]
    first, second = first_two(verdicts)
    assert tv(first, target(LOGITS[0], 0.8)) < MAX_TV
    assert sum(second.values()) > N / 5  # the first draft (p ~ 0.26) is kept often
    assert tv(second, target(LOGITS[1], 0.8)) < MAX_TV


def test_filters_cut_the_distribution_before_the_acceptance_test() -> None:
    params = SamplingParams(temperature=1.0, top_k=3, seed=11)
    sampler = make_request_sampler(params)
    verdicts = [verify_sampled(sampler, LOGITS, DRAFTS) for _ in range(N)]
    first, second = first_two(verdicts)
    assert tv(first, target(LOGITS[0], 1.0, top_k=3)) < MAX_TV
    # Draft 2 is outside position 1's top 3: never kept.
    assert all(v.num_accepted < 2 for v in verdicts)
    assert tv(second, target(LOGITS[1], 1.0, top_k=3)) < MAX_TV


def test_processors_shape_each_drafted_position_in_order() -> None:
    """A processor that sees the context: it bans the token just fed, so the
    distribution at each position depends on the drafts before it."""
    seen: list[list[int]] = []

    def ban_last(context: mx.array, logits: mx.array) -> mx.array:
        last = int(context[-1].item())
        seen.append(context.tolist())
        return mx.where(mx.arange(VOCAB) == last, -mx.inf, logits)

    params = SamplingParams(temperature=1.0, seed=3)
    row = SimpleNamespace(
        processors=[ban_last], sampler=make_request_sampler(params), greedy=False, logprobs=None
    )
    seq = [4, *DRAFTS]  # the fed token, then the drafts
    verdicts = [verify_processed(row, LOGITS, seq, mx.array([1, 2])) for _ in range(N)]
    assert seen[0] == [1, 2, 4]
    assert [1, 2, 4, 5] in seen  # position 1 ran with the first draft in its context
    first, second = first_two(verdicts)
    banned0 = LOGITS[0] + mx.where(mx.arange(VOCAB) == 4, -mx.inf, 0.0)
    banned1 = LOGITS[1] + mx.where(mx.arange(VOCAB) == 5, -mx.inf, 0.0)
    assert tv(first, target(banned0, 1.0)) < MAX_TV
    assert tv(second, target(banned1, 1.0)) < MAX_TV
