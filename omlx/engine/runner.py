"""The batched forward step: continuous batching on mlx-lm's BatchGenerator.

MLX thread only. The runner knows nothing about finish reasons: the scheduler
decides those and the engine removes finished requests.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from omlx.engine.solo import SoloSequence
from omlx.scheduler import Request, SamplingParams, TokenOutput

Sampler = Callable[[mx.array], mx.array]

# BatchGenerator requires a positive per-request limit; ours (the scheduler's)
# always fires first or at the same step.
_NO_STOPS = StopSequences()


def make_request_sampler(params: SamplingParams) -> Sampler:
    """Greedy requests share one sampler (one batched argmax); others get their own
    PRNG key so a seed reproduces the same tokens whatever else is in the batch."""
    if params.is_greedy:
        return greedy_sampler
    key = mx.random.key(params.seed if params.seed is not None else secrets.randbits(63))
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0.0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    inv_temp = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


def make_request_processors(request: Request) -> list[Any]:
    """Repetition penalty, then the grammar mask (last, so nothing re-allows a token)."""
    params = request.sampling
    processors = []
    if params.repetition_penalty != 1.0:
        processors += make_logits_processors(repetition_penalty=params.repetition_penalty)
    if request.grammar is not None:
        processors.append(request.grammar.new_processor())
    return processors


class BatchRunner:
    def __init__(
        self, model: Any, *, max_batch_size: int, prefill_step_size: int, stream: mx.Stream
    ):
        self._model = model
        self._options = dict(
            completion_batch_size=max_batch_size,
            prefill_batch_size=max_batch_size,
            prefill_step_size=prefill_step_size,
            stream=stream,
        )
        self._prefill_step_size = prefill_step_size
        self._gen = BatchGenerator(model, **self._options)
        self._uid_to_rid: dict[int, str] = {}
        self._rid_to_uid: dict[str, int] = {}
        # A lone request runs unbatched (see solo.py); None while batching.
        self._solo: SoloSequence | None = None
        self._solo_request: Request | None = None
        # Tokens sampled by a solo sequence just before it joined the batch.
        self._unreported: list[TokenOutput] = []

    @property
    def has_work(self) -> bool:
        return bool(self._uid_to_rid or self._solo or self._unreported)

    def add(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        if not requests:
            return
        if len(requests) == 1 and self._solo is None and not self._uid_to_rid:
            self._start_solo(requests[0])
            return
        if self._solo is not None:
            self._solo_to_batch()
        self._insert(requests, [[list(r.prompt_ids)] for r in requests])

    def _start_solo(self, request: Request) -> None:
        self._solo_request = request
        self._solo = SoloSequence(
            self._model,
            request.request_id,
            list(request.prompt_ids),
            make_request_sampler(request.sampling),
            make_request_processors(request),
            self._prefill_step_size,
        )

    def _solo_to_batch(self) -> None:
        assert self._solo is not None and self._solo_request is not None
        state = self._solo.handoff()
        request = self._solo_request
        self._solo = self._solo_request = None
        if state.unreported is not None:
            self._unreported.append(TokenOutput(request.request_id, state.unreported))
        uids = self._gen.insert_segments(
            [[state.feed]],
            max_tokens=[request.sampling.max_tokens],
            caches=[state.cache] if state.cached_tokens else None,
            all_tokens=[state.cached_tokens],
            samplers=[state.sampler],
            logits_processors=[state.processors],
            stop_sequences=[_NO_STOPS],
        )
        self._track(uids, [request])

    def _insert(self, requests: list[Request], segments: list[list[list[int]]]) -> None:
        uids = self._gen.insert_segments(
            segments,
            max_tokens=[r.sampling.max_tokens for r in requests],
            samplers=[make_request_sampler(r.sampling) for r in requests],
            logits_processors=[make_request_processors(r) for r in requests],
            stop_sequences=[_NO_STOPS] * len(requests),
        )
        self._track(uids, requests)

    def _track(self, uids: list[int], requests: list[Request]) -> None:
        for uid, request in zip(uids, requests, strict=True):
            self._uid_to_rid[uid] = request.request_id
            self._rid_to_uid[request.request_id] = uid

    def remove(self, request_ids: Iterable[str]) -> None:
        request_ids = set(request_ids)
        if self._solo is not None and self._solo.request_id in request_ids:
            self._solo = self._solo_request = None
        self._unreported = [t for t in self._unreported if t.request_id not in request_ids]
        uids = [self._rid_to_uid.pop(rid) for rid in request_ids if rid in self._rid_to_uid]
        for uid in uids:
            del self._uid_to_rid[uid]
        if uids:
            self._gen.remove(uids)

    def step(self) -> list[TokenOutput]:
        """One decode step for running sequences plus one prefill chunk."""
        outputs, self._unreported = self._unreported, []
        if self._solo is not None:
            token = self._solo.step()
            if token is not None:
                outputs.append(TokenOutput(self._solo.request_id, token))
        if self._uid_to_rid:
            _, generated = self._gen.next()
            outputs.extend(
                TokenOutput(self._uid_to_rid[r.uid], r.token)
                for r in generated
                if r.uid in self._uid_to_rid
            )
        return outputs

    def reset(self) -> None:
        """Drop every sequence (after an MLX error left the batch unusable)."""
        self._gen.close()
        self._gen = BatchGenerator(self._model, **self._options)
        self._uid_to_rid.clear()
        self._rid_to_uid.clear()
        self._solo = self._solo_request = None
        self._unreported.clear()

    def close(self) -> None:
        self._gen.close()
