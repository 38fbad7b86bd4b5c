"""How one request samples: its sampler (greedy shared, else its own PRNG key) and
its logits processors (repetition penalty, then the grammar mask). MLX thread only."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from omlx.engine.batch import Sampler
from omlx.grammar.processor import Draw, greedy_draw, temperature_draw
from omlx.scheduler import Request, SamplingParams


def make_request_sampler(params: SamplingParams, num_sampled: int = 0) -> Sampler:
    """Greedy requests share one sampler (one batched argmax); others get their own
    PRNG key so a seed reproduces the same tokens whatever else is in the batch.
    ``num_sampled``: tokens a resumed request sampled before it was preempted (its
    key advances past them, so a seed gives the same output as without preemption).

    Samplers get raw logits (argmax and categorical need no log-softmax; the
    logprobs some requests ask for are computed beside, logprobs.py); the nucleus, min-p and
    top-k filters normalise first (top-p exponentiates, which overflows on raw logits)."""
    if params.is_greedy:
        return greedy_sampler
    return RequestSampler(params, num_sampled)


class RequestSampler:
    """A sampling (temperature > 0) request's draws, with its own PRNG key.
    ``scaled`` gives the logits it draws from (filters and temperature applied),
    which speculative verification needs for its acceptance test."""

    def __init__(self, params: SamplingParams, num_sampled: int = 0):
        # Any integer seed (clients send -1 or 64-bit values): MLX takes a uint64.
        seed = params.seed % 2**64 if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        for _ in range(num_sampled):
            self.next_key()
        filters: list[Callable[[mx.array], mx.array]] = []
        if 0.0 < params.top_p < 1.0:
            filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0.0:
            filters.append(lambda x: apply_min_p(x, params.min_p, 1))
        if params.top_k > 0:
            filters.append(lambda x: apply_top_k(x, params.top_k))
        self._filters = filters
        self._inv_temp = 1.0 / params.temperature

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def keys_ahead(self, n: int) -> list[mx.array]:
        """The keys of the next ``n`` draws, not used up: a speculative step draws
        at every drafted position, then ``advance``s past the tokens it hands out."""
        key, subs = self._key, []
        for _ in range(n):
            key, sub = mx.random.split(key)
            subs.append(sub)
        return subs

    def advance(self, n: int) -> None:
        """Use up the keys of ``n`` draws (made with ``keys_ahead``)."""
        for _ in range(n):
            self.next_key()

    def draw(self, logits: mx.array, key: mx.array) -> mx.array:
        """The token drawn from ``logits`` (1, V) with ``key``."""
        return mx.random.categorical(self.scaled(logits), key=key)

    def scaled(self, logits: mx.array) -> mx.array:
        if self._filters:
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for f in self._filters:
            logits = f(logits)
        return logits * self._inv_temp

    def __call__(self, logits: mx.array) -> mx.array:
        return self.draw(logits, self.next_key())


def make_request_processors(request: Request) -> list[Any]:
    """Repetition penalty, then the grammar mask (last, so nothing re-allows a token)."""
    params = request.sampling
    processors = []
    if params.repetition_penalty != 1.0:
        processors += make_logits_processors(repetition_penalty=params.repetition_penalty)
    if request.grammar is not None:
        grammar = request.grammar.new_processor(draw=grammar_draw(params))
        grammar.replay(request.resumed_output_ids)
        processors.append(grammar)
    return processors


def grammar_draw(params: SamplingParams) -> Draw | None:
    """How the grammar's fast path draws this request's pick; None when only the
    full mask is exact (top-p/top-k/min-p cut by the masked distribution) or
    the request wants logprobs (of the masked distribution, not of one token)."""
    if params.logprobs is not None:
        return None
    if params.is_greedy:
        return greedy_draw
    if params.top_p >= 1.0 and params.top_k <= 0 and params.min_p <= 0.0:
        return temperature_draw(params.temperature, params.seed)
    return None
