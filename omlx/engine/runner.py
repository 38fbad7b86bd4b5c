"""The forward step: executes the scheduler's plan. Which code decodes a request
follows from where the plan placed it (``SchedulerOutput.placements``,
scheduler/placement.py):

- SOLO: ``solo.SoloSequence`` prefills it (one pass, or chunks) and samples its
  first token in the same forward; it decodes there (``compiled.CompiledDecode``
  when proven) until the plan moves it into the batch (below).
- BATCH: ``batch.PrefillBatch`` prefills it, a chunk per step beside the other new
  prompts (after a shared opening, ``openings.py``, when the plan has one); its last
  prompt token goes to ``batch.DecodeBatch``, which decodes every row in one forward
  (``compiled_batch.CompiledBatchStep`` when proven; with drafts from ``ngram.py`` or
  ``draft_model.py``, verified by ``speculative.py``).
- SIDE: a ``SoloSequence`` with block-boundary snapshots prefills it; at its last
  prompt token it joins the ``DecodeBatch``.
- IMAGE_SIDE: ``image_prefill.image_sequence`` encodes the images and prefills the
  prompt the same way, then joins the ``DecodeBatch``.
- FORK: ``forks.ChoiceForks`` holds it until its leader's prompt is in, then it
  joins the ``DecodeBatch`` with a copy of the leader's cache.

What it holds, one owner each: batch rows in ``batch.py``'s two batches, waiting
choices in ``forks.ChoiceForks``, one ``sequences.Running`` record (its placement, its
sequence, its request) per request running as a sequence of its own (solo, side, image
side), and what it owes the prefix cache in ``prompt_stores.PromptStores``. The plan
decides where each request runs and when the solo sequence moves; the runner decides
only what follows from running: a side sequence joins the batch at its last prompt
token, a fork when its leader's prompt is in, and each chunk's size under the plan's
cap (prefill step size, solo one-pass).

MLX thread only. The runner knows nothing about finish reasons: the scheduler
decides those, and the next plan drops the finished requests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.utils import maybe_set_recommended_wired_limit

from omlx.cache.hot import ClearTier
from omlx.cache.kv_codec import num_tokens_held
from omlx.cache.prefix import AgreeHits, CacheHit, PrefixCache
from omlx.cache.prefix_index import NO_HIT
from omlx.engine.batch import DecodeBatch, PrefillBatch, Row, merge_caches, merges
from omlx.engine.compiled import CompiledDecode
from omlx.engine.compiled_batch import CompiledBatchStep, CompiledSteps
from omlx.engine.draft_model import DraftModel, DraftProposer
from omlx.engine.forks import FORK_PAST_OPENING, ChoiceForks
from omlx.engine.image_prefill import image_sequence, usable_hit
from omlx.engine.ngram import drafter_for, speculates
from omlx.engine.openings import share_openings, shares_openings
from omlx.engine.prompt_stores import PromptStores
from omlx.engine.quantized_cache import joins_batch
from omlx.engine.sampling import make_request_processors, make_request_sampler
from omlx.engine.sequences import Running, Sequences
from omlx.engine.solo import SoloSequence
from omlx.engine.strategy import ExecutionStrategy
from omlx.errors import ImageEmbeddingMismatchError, OmlxError
from omlx.mlx_types import CacheLayer, LanguageModel, prompt_cache
from omlx.scheduler import Request, TokenOutput
from omlx.scheduler.openings import SharedOpening
from omlx.scheduler.placement import Placement, Placements, RunnerLayout, SoloState, place
from omlx.scheduler.plan import PrefillChunk, RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from omlx.models.vlm import VisionEncoder

log = logging.getLogger(__name__)


class BatchRunner:
    """``prefix_cache``: look prompts up before prefill; store a request's blocks
    once its prompt is in the cache and again when it leaves. ``shared_hits``: the
    model is split across ranks, each with its own cache; every rank restores the hit
    length all of them hold (omlx/distributed/shared_hits.py).

    Where each request runs is the plan's (scheduler/placement.py; ``execute``): a lone
    request prefills as a ``SoloSequence`` (and decodes there when the model has no
    proven compiled batch step; otherwise it moves to the batch after its first token).
    Once several run, new prompts prefill together (``PrefillBatch``) and every
    sequence past its prompt decodes in one ``DecodeBatch``; a solo sequence moves
    over with its cache.
    The scheduler bounds how many run at once (``max_concurrent_requests``).
    ``compiled``: a lone sequence's decode steps replay one compiled graph, and the
    batch's steps run each layer's work around attention compiled, when the model
    qualifies (compiled.py).
    """

    def __init__(
        self,
        model: LanguageModel,
        *,
        prefill_step_size: int,
        stream: mx.Stream,
        prefix_cache: PrefixCache | None = None,
        strategy: ExecutionStrategy | None = None,
        vision: VisionEncoder | None = None,
        shared_hits: AgreeHits | None = None,
        compiled: CompiledSteps | None = None,
    ):
        if strategy is None:
            strategy = ExecutionStrategy.choose("auto", mx.default_device().type.name)
        self.strategy = strategy
        self._model = model
        # A vision-language model's encoder (omlx.models.vlm.VisionEncoder), or None.
        self._vision = vision
        self._prefix = prefix_cache
        self._apart = not merges(prompt_cache(model))  # RunnerLayout.apart
        # Whether a burst's requests may start from a shared opening's cache (the
        # scheduler plans openings only then): batched requests of sliceable caches.
        self.shares_openings = shares_openings(model) and not (
            prefix_cache is not None and prefix_cache.needs_snapshots
        )
        # A model split across ranks: the hit lengths every rank holds (shared_hits.py).
        self._shared_hits = shared_hits
        self._prefill_step_size = prefill_step_size
        self._stream = stream
        # A lone sequence's decode step and the batch's, compiled (None when the
        # model does not qualify or the strategy runs eager).
        if compiled is None:
            compiled = CompiledSteps.for_model(model, strategy)
        self._decoder, self._batch_step = compiled.solo, compiled.batch
        # The draft model proposing tokens (None: prompt lookup).
        self._draft: DraftModel | None = None
        self._prefill, self._decode = self._new_batches()
        # A request's choices (same prompt, started together) wait for one to prefill
        # it, when it is longer than the shared opening covers.
        self._forks = ChoiceForks(self._row)
        # On a Mac, keep the weights wired as mlx-lm's generators do (None elsewhere).
        self._old_wired_limit = maybe_set_recommended_wired_limit()
        # The requests running as sequences of their own (sequences.py): a lone
        # request unbatched (solo.py), and those prefilling on the side (models whose
        # cache cannot be cut later, prompts with images) until they join the batch.
        self._sequences = Sequences()
        # Tokens sampled by a solo or side sequence just before it joined the batch
        # (out first in the step's outputs).
        self._unreported: list[TokenOutput] = []
        # Requests that failed to start since the last step's output (its ``failed``).
        self._failed: dict[str, OmlxError] = {}
        # What the prefix cache gets from each request, at the start of the next step.
        self._stores = PromptStores(prefix_cache, self._layers_of)

    @property
    def compiled_decoder(self) -> CompiledDecode | None:
        """The compiled decode step of lone sequences (None: they decode eagerly)."""
        return self._decoder

    @property
    def compiled_batch_step(self) -> CompiledBatchStep | None:
        """The batch's compiled decode step (None: the batch decodes eagerly)."""
        return self._batch_step

    @property
    def num_decode_steps(self) -> int:
        """The batch's forwards so far (plain and speculative)."""
        return self._decode.num_steps

    @property
    def compiled_draft_step(self) -> CompiledBatchStep | None:
        """The draft model's compiled step (None: no draft model, or it runs eager)."""
        return self._draft.compiled if self._draft is not None else None

    def prove_compiled(self) -> None:
        """Run the compiled steps' one-time checks now (the pool does at model
        load), so the first requests do not pay them (their cost: benchmarks/README.md,
        "Figures behind design choices")."""
        with mx.stream(self._stream):
            for step in (self._decoder, self._batch_step):
                if step is not None:
                    step.prove()

    @property
    def has_work(self) -> bool:
        return bool(
            self._decode
            or self._prefill
            or self._sequences
            or self._unreported
            or self._stores.pending
        )

    def add(
        self, requests: Iterable[Request], openings: Sequence[SharedOpening] = ()
    ) -> dict[str, int]:
        """Start requests where the placement rules put them beside what runs now
        (``execute`` takes the plan's placements instead); returns the prompt tokens
        each got from the prefix cache. ``openings``: shared openings among them."""
        requests = list(requests)
        return self._start(requests, openings, place(requests, self.layout()))

    def _start(
        self, requests: Sequence[Request], openings: Sequence[SharedOpening], placed: Placements
    ) -> dict[str, int]:
        """Start requests as placed, moving the solo sequence first as planned (no
        requests: the step moves it); returns the prompt tokens each got from the
        prefix cache."""
        if not requests:
            return {}
        if any(r.num_resumed_tokens for r in requests):
            # A preempted request's blocks were stored on its way out: now, so it hits.
            self._stores.run()
        self._move_solo(placed.solo_move)
        where = placed.where
        with_images = {
            r.request_id: self._start_with_images(r)
            for r in requests
            if where[r.request_id] is Placement.IMAGE_SIDE
        }
        cached = {rid: n for rid, n in with_images.items() if n}
        text = [r for r in requests if where[r.request_id] is not Placement.IMAGE_SIDE]
        if not text:
            return cached
        solo = [r for r in text if where[r.request_id] is Placement.SOLO]
        # A solo or side sequence feeds its restored cache as it is (room saves a
        # copy); a batched one is merged into the batch's cache (a copy anyway).
        room = bool(solo) or (self._prefix is not None and self._prefix.needs_snapshots)
        hits = self._lookup(text, room)
        for r in text:
            self._stores.track(r)
        for r in text:
            if where[r.request_id] in (Placement.SOLO, Placement.SIDE):
                sequence = self._sequence(r, hits[r.request_id])
                self._sequences.start(where[r.request_id], sequence, r)
        rows = [r for r in text if where[r.request_id] in (Placement.BATCH, Placement.FORK)]
        if rows:
            self._start_rows(rows, openings, hits, placed.leaders)
        cached.update({rid: hit.num_tokens for rid, hit in hits.items() if hit is not None})
        return cached

    def _start_rows(
        self,
        requests: list[Request],
        openings: Sequence[SharedOpening],
        hits: dict[str, CacheHit | None],
        leaders: Mapping[str, str],
    ) -> None:
        """Batch rows from their hits or shared openings; a fork waits for its leader."""
        with mx.stream(self._stream):
            for r in requests:
                if r.request_id in leaders:
                    self._forks.wait(r, leaders[r.request_id])
            started = [r for r in requests if r.request_id not in leaders]
            shared = share_openings(self._model, openings, started, hits)
            for r in started:
                hit = hits[r.request_id]
                if r.request_id in shared:
                    done, cache = shared[r.request_id]
                elif hit is not None:
                    done, cache = hit.num_tokens, hit.layers
                else:
                    done, cache = 0, prompt_cache(self._model)
                row = self._row(r, r.prompt_ids[:done])
                self._start_batched(row, cache, done, r.prompt_ids[done:])

    def _start_with_images(self, request: Request) -> int:
        """A prompt with images (or any, RunnerLayout.embedded_prompts) prefills on the
        side (image_prefill.py). Its blocks are keyed by the images' hashes: their
        tokens' ids are the same whatever the image. Returns the prompt tokens the
        prefix cache held."""
        assert self._vision is not None, "images reached a text-only model"
        keys = request.images.keys if request.images is not None else ()
        hit = None
        self._stores.track(request, keys)
        if self._prefix is not None:
            template = prompt_cache(self._model)
            hit = self._prefix.lookup(request.prompt_ids, template, extra_keys=keys)
            hit = usable_hit(self._vision, list(request.prompt_ids), hit)
        with mx.stream(self._stream):
            try:
                sequence = image_sequence(
                    self._model,
                    self._vision,
                    request,
                    sampler=make_request_sampler(request.sampling, request.num_resumed_tokens),
                    processors=make_request_processors(request),
                    prefill_step_size=self._prefill_step_size,
                    hit=hit,
                    block_size=self._prefix.block_size if self._prefix is not None else 0,
                    on_boundary=self._stores.boundary_hook(request),
                )
            except ImageEmbeddingMismatchError as exc:
                # This request alone: it leaves through the next plan (its stores too).
                self._failed[request.request_id] = exc
                return 0
        self._sequences.start(Placement.IMAGE_SIDE, sequence, request)
        return hit.num_tokens if hit is not None else 0

    @staticmethod
    def _row(request: Request, fed: Sequence[int]) -> Row:
        """A batch row for ``request`` whose processors have seen ``fed``."""
        return Row.make(
            request.request_id,
            make_request_sampler(request.sampling, request.num_resumed_tokens),
            make_request_processors(request),
            fed,
            request.sampling.logprobs,
            drafter_for(request, request.prompt_ids),
        )

    @property
    def num_draft(self) -> int:
        """Tokens each decoding request may draft per step (0: no speculation)."""
        return self._decode.num_draft

    @num_draft.setter
    def num_draft(self, value: int) -> None:
        # A plain int swap: the MLX thread reads it at its next step.
        self._decode.num_draft = value

    def set_draft(self, model: LanguageModel | None, target_vocab: int) -> None:
        """A draft model proposes the drafts from now on (None: prompt lookup). Its
        forwards run compiled like the target's batch step when the strategy
        compiles and the draft qualifies (proven here, once)."""
        self._draft = None
        if model is not None:
            compiled = CompiledBatchStep.for_model(model) if self.strategy.compiled else None
            if compiled is not None:
                with mx.stream(self._stream):
                    compiled.prove()
            self._draft = DraftModel(model, target_vocab, compiled)
        self._decode.draft = self._proposer()

    def _proposer(self) -> DraftProposer | None:
        return self._draft.proposer(self._prefill_step_size) if self._draft else None

    def speculation_plan(self) -> list[PrefillChunk]:
        """The positions the next decode step may verify per drafting request
        (its token and drafts, and its draft model's forwards), as chunks for the
        memory gate. Rows that join the batch after this plan do not draft in the
        step: the next plan has them."""
        return [
            PrefillChunk(rid, width, context + width, width)
            for rid, width, context in self._decode.speculation_plan()
        ]

    def hold_drafts(self) -> None:
        """The memory gate: the next decode step drafts nothing (plain decode;
        tokens accepted earlier still go through)."""
        self._decode.hold_drafts = True

    def speculative_stats(self) -> dict[str, int]:
        """Speculative decoding counters since the model loaded (for /metrics)."""
        return self._decode.spec_stats.as_dict()

    def _start_batched(
        self, row: Row, cache: list[CacheLayer], num_cached: int, rest: Sequence[int]
    ) -> None:
        """Prefill ``rest`` after ``cache`` with the other new prompts; a single
        token left goes straight to the decode step, which samples from it."""
        if len(rest) > 1:
            self._prefill.add(row, cache, num_cached, rest)
        else:
            self._decode.join(*self._forks.fork([row], list(rest), merge_caches([cache])))

    def _lookup(self, requests: list[Request], room: bool) -> dict[str, CacheHit | None]:
        """Each request's prefix-cache hit; split across ranks, one every rank holds (a
        rank keeping no cache still takes part in ``shared_hits``: it holds none)."""
        if self._prefix is None:
            if self._shared_hits is not None:
                self._shared_hits([NO_HIT] * len(requests))
            return dict.fromkeys((r.request_id for r in requests), None)
        found = self._prefix.lookup_together(
            [r.prompt_ids for r in requests],
            partial(prompt_cache, self._model),
            room=room,
            agree=self._shared_hits,
        )
        return {r.request_id: hit for r, hit in zip(requests, found, strict=True)}

    def _sequence(self, request: Request, hit: CacheHit | None) -> SoloSequence:
        """An unbatched sequence for ``request`` (snapshots at block boundaries
        when the model needs them)."""
        prefix = self._prefix
        return SoloSequence(
            self._model,
            request.request_id,
            list(request.prompt_ids),
            make_request_sampler(request.sampling, request.num_resumed_tokens),
            make_request_processors(request),
            self._prefill_step_size,
            cache=hit.layers if hit else None,
            num_cached=hit.num_tokens if hit else 0,
            block_size=prefix.block_size if prefix is not None else 0,
            on_boundary=self._stores.boundary_hook(request),
            decoder=self._decoder,
            logprobs=request.sampling.logprobs,
        )

    def layout(self) -> RunnerLayout:
        """Where each request runs now and what the placement rules need to know
        (scheduler/placement.py decides; the plan carries the decision)."""
        placed = {row.request_id: Placement.BATCH for row in self._prefill.rows}
        placed.update({row.request_id: Placement.BATCH for row in self._decode.rows})
        placed.update(self._sequences.placed())
        leaders = self._forks.leaders()
        placed.update(dict.fromkeys(leaders, Placement.FORK))
        running = self._sequences.solo
        solo = self._solo_state(running) if running is not None else None
        step = self._batch_step
        return RunnerLayout(
            placed=placed,
            leaders=leaders,
            solo=solo,
            solo_prefill=self.strategy.solo_prefill,
            snapshots=self._prefix is not None and self._prefix.needs_snapshots,
            embedded_prompts=self._vision is not None and self._vision.family.embeds_text_prompts,
            batch_compiled=step is not None and step.proven and not step.failed,
            apart=self._apart,
            min_fork_prompt=self._prefill_step_size + FORK_PAST_OPENING,
        )

    def _solo_state(self, running: Running) -> SoloState:
        """The lone sequence as the placement rules see it (movable: its first token
        is out and its cache is plain or quantized KV layers, which the batch can take)."""
        solo, request = running.sequence, running.request
        return SoloState(
            solo.request_id,
            solo.num_pending,
            movable=not solo.num_pending and solo.decoding and joins_batch(solo.cache),
            would_draft=self.num_draft > 0 and speculates(request),
        )

    def _move_solo(self, move: Placement | None) -> None:
        """The solo sequence moves where the plan said (None: it stays)."""
        running = self._sequences.solo
        if move is None or running is None:
            return
        if move is Placement.SIDE:
            self._sequences.to_side(running)
        else:
            self._join(self._sequences.pop(running.request_id))

    def _join(self, running: Running) -> None:
        """A solo or side sequence continues batched, with its cache."""
        sequence, request = running.sequence, running.request
        state = sequence.handoff()
        rid = sequence.request_id
        drafter = drafter_for(request, [*state.cached_tokens, *state.feed])
        row = Row.make(
            rid, state.sampler, state.processors, state.cached_tokens, sequence.logprobs, drafter
        )
        with mx.stream(self._stream):
            if state.unreported is not None:
                self._unreported.append(
                    TokenOutput(rid, state.unreported, state.unreported_logprobs)
                )
            self._start_batched(row, state.cache, len(state.cached_tokens), state.feed)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one planned step: drop the requests leaving (their blocks go to the
        prefix cache), start the admitted ones where the plan placed them (from
        their cache hits and shared openings), move the solo sequence if it says
        so, cap the prefill chunks as the memory gate said, and run the forward."""
        self.remove(plan.leaving)
        hits = self._start(plan.admitted, plan.openings, plan.placements)
        cached = {r.request_id: hits.get(r.request_id, 0) for r in plan.admitted}
        self.cap_prefill(plan.prefill_cap)
        if not plan.speculate:
            self.hold_drafts()
        # Starting requests moved the solo sequence; else the step moves it.
        move = None if plan.admitted else plan.placements.solo_move
        tokens = tuple(self._step(move))
        failed, self._failed = self._failed, {}
        return RunnerOutput(tokens, cached, failed)

    def remove(self, request_ids: Iterable[str]) -> None:
        """Take requests out (finished or aborted); their blocks go to the prefix cache."""
        request_ids = set(request_ids)
        leaving: dict[str, tuple[list[CacheLayer], int] | None] = dict.fromkeys(request_ids)
        leaving.update(self._sequences.remove(request_ids))
        self._unreported = [t for t in self._unreported if t.request_id not in request_ids]
        keep_caches = self._prefix is not None
        orphans = self._forks.drop(request_ids)
        with mx.stream(self._stream):
            for r in orphans:  # their leader left before its prompt was in
                self._start_batched(self._row(r, ()), prompt_cache(self._model), 0, r.prompt_ids)
            leaving.update(self._prefill.remove(request_ids, extract=keep_caches))
            for rid, layers in self._decode.remove(request_ids, extract=keep_caches).items():
                leaving[rid] = (layers, num_tokens_held(layers))
        for rid, held in leaving.items():
            self._stores.leave(rid, held)

    def prefill_plan(self) -> list[PrefillChunk]:
        """The prefill work the next ``step`` will do, per request (for the memory
        gate). A batched chunk is planned as attending over the whole prompt: an
        upper bound (rows are right-padded to the longest chunk)."""
        plan = []
        for seq in self._sequences.prefilling():
            if n := seq.next_prefill_tokens():
                context, left = seq.num_cached + n, seq.num_pending
                plan.append(PrefillChunk(seq.request_id, n, context, left, seq.runs_whole))
        for rid, n, left, whole in self._prefill.plan():
            plan.append(PrefillChunk(rid, n, whole, left))
        return plan

    def cap_prefill(self, cap: int | None) -> None:
        """The memory gate's cap on the next step's prefill chunks (None: as
        planned; 0: prefill waits this step while decoding goes on)."""
        for seq in self._sequences.prefilling():
            seq.cap_next_chunk(cap)
        self._prefill.cap_next_chunk(cap)

    def step(self) -> list[TokenOutput]:
        """One step outside a plan: the solo sequence moves as the placement rules
        say for the runner as it is (``execute`` takes the plan's move)."""
        return self._step(place((), self.layout()).solo_move)

    def _step(self, move: Placement | None) -> list[TokenOutput]:
        """One step: the solo sequence moves as planned (``move``); then its step,
        or a prefill chunk of the new prompts and one decode step of every sequence
        past its prompt (those whose prompt just ended included: their first token
        leaves in this step)."""
        self._stores.run()
        self._move_solo(move)
        outputs: list[TokenOutput] = []
        running = self._sequences.solo
        if running is not None and not running.sequence.held:
            solo = running.sequence
            token = solo.step()
            if token is not None:
                outputs.append(TokenOutput(solo.request_id, token, solo.last_logprobs))
        # A side sequence that sampled its first token hands it over as it joins:
        # out before the batch's next token for it.
        self._step_side()
        outputs, self._unreported = [*self._unreported, *outputs], []
        with mx.stream(self._stream):
            if self._prefill:
                done, cache = self._prefill.step()
                rows, feed = [r for r, _ in done], [t for _, t in done]
                self._decode.join(*self._forks.fork(rows, feed, cache))
            outputs.extend(self._decode.step())
        self._stores.note(outputs)
        return outputs

    def _step_side(self) -> None:
        """One prefill chunk for each side sequence; those down to their last
        prompt token (or past it: a whole-prompt pass, a last token fed apart) join
        the batch, or, where their cache cannot batch (llama4's chunked layers), go on as
        the solo sequence."""
        for running in self._sequences.sides():
            seq = running.sequence
            if seq.held:
                continue
            if seq.num_pending > 1 or seq.feeds_last_token:
                seq.step()
            if seq.num_pending > 1 or seq.feeds_last_token:
                continue
            if merges(seq.cache) or self._sequences.solo is not None:
                self._join(self._sequences.pop(running.request_id))
            else:
                self._sequences.to_solo(running)

    # -- prefix cache ------------------------------------------------------

    def _layers_of(self, request_id: str) -> list[CacheLayer] | None:
        """A running request's cache layers (None: it has none now)."""
        running = self._sequences.solo
        if running is not None and running.request_id == request_id:
            return running.sequence.cache
        with mx.stream(self._stream):
            return self._decode.extract(request_id)

    def flush_cache_stores(self) -> None:
        """Store now what ended requests left for the prefix cache (stores wait for
        the next step so responses leave first; the gate's reading and a clear must
        find those blocks). The lone sequence's lazily queued forward runs first, on
        every rank of a split model alike: a store reads the cache it writes."""
        running = self._sequences.solo
        if running is not None:
            with mx.stream(self._stream):
                running.sequence.settle()
        self._stores.run()

    def clear_prefix_cache(self, tier: ClearTier) -> None:
        """Drop this model's blocks from its prefix cache's tiers (a model split
        across ranks: every rank's, since rank 0's runner calls are replayed),
        the blocks of requests that just ended included."""
        self._stores.clear(tier)

    def reset(self) -> None:
        """Drop every sequence (after an MLX error left the batch unusable)."""
        self._stores.reset()
        old = self._decode
        self._prefill, self._decode = self._new_batches()
        self._decode.num_draft, self._decode.spec_stats = old.num_draft, old.spec_stats
        self._sequences.clear()
        self._unreported.clear()
        self._failed.clear()
        self._forks.clear()

    def _new_batches(self) -> tuple[PrefillBatch, DecodeBatch]:
        """Empty batches (at the start, and after an MLX error)."""
        decode = DecodeBatch(self._model, self.strategy, self._batch_step)
        decode.draft = self._proposer()
        return PrefillBatch(self._model, self._prefill_step_size), decode

    def close(self) -> None:
        self._stores.run()
        if self._old_wired_limit is not None:
            mx.synchronize(self._stream)
            mx.set_wired_limit(self._old_wired_limit)
            self._old_wired_limit = None
