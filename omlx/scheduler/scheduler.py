"""FCFS scheduler: a bounded waiting queue feeding a bounded running set."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

from omlx.errors import QueueFullError
from omlx.memory.throttle import PrefillShape
from omlx.scheduler.openings import SharedOpening, plan_openings
from omlx.scheduler.placement import RunnerLayout, place
from omlx.scheduler.plan import KVLoad, MemoryView, PrefillChunk, SchedulerOutput
from omlx.scheduler.request import Request, RequestStatus, RequestUpdate, TokenOutput

log = logging.getLogger(__name__)

# (request at the head of the queue, requests running) -> admit now?
AdmitCheck = Callable[[Request, int], bool]


@dataclass(slots=True)
class _Running:
    request: Request
    # Output tokens counted against max_tokens (a resumed request's earlier ones too).
    num_output_tokens: int = 0
    # Tokens produced since it was (re)admitted: what a preemption appends to its prompt.
    new_ids: list[int] = field(default_factory=list)

    @classmethod
    def admit(cls, request: Request) -> _Running:
        return cls(request, request.num_resumed_tokens)


class Scheduler:
    """Decides which requests run and when each one is finished.

    Not thread-safe: the MLX worker thread owns it.
    """

    def __init__(
        self,
        max_running: int,
        max_waiting: int,
        *,
        gather_s: float = 0.0,
        gather_max_s: float = 0.0,
        prefill_step_size: int = 512,
        share_openings: bool = False,
        name: str = "",
        kv_step: int = 1,
        held_states: Callable[[Request], int] = lambda request: 0,
        one_forward: Callable[[Request], bool] = lambda request: False,
    ):
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        self.max_running = max_running
        self.max_waiting = max_waiting
        # Burst gathering while idle (see ``ready_in``); 0 admits at once.
        self.gather_s = gather_s
        self.gather_max_s = gather_max_s
        self.name = name  # the model's, for the log
        # The runner's prefill chunk: an admitted request's first chunk is planned so.
        self.prefill_step_size = prefill_step_size
        # Whether the runner can start a burst from shared openings (plain KV caches).
        self.share_openings = share_openings
        # The columns the model's KV caches grow by at a time (mlx-lm's ``step``, read
        # by the engine: engine/kv_measure.py); 1 counts them as tokens.
        self.kv_step = kv_step
        # The image state rows a request holds while it runs (mllama's; 0 for others).
        self._held_states = held_states
        # Whether a request's prompt prefills in one forward (a whole-prompt image prompt).
        self._one_forward = one_forward
        # Requests preempted, by what ran short ("kv_capacity", "memory").
        self.preemptions: Counter[str] = Counter()
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: dict[str, _Running] = {}
        # Requests that left the running set since the last plan (finished, aborted,
        # failed): the next plan drops them from the runner.
        self._left: list[str] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def kv_load(self) -> KVLoad:
        """The running requests' KV (prompt plus generated tokens each) as their caches
        hold it: each row padded to the longest, grown ``kv_step`` columns at a time,
        with the image states it holds (plan.KVLoad). What the memory view prices KV in
        flight by."""
        load = KVLoad(step=self.kv_step)
        for r in self._running.values():
            num_tokens = r.request.num_prompt_tokens + len(r.new_ids)
            load = load.with_row(num_tokens, self._held_states(r.request))
        return load

    @property
    def capacity(self) -> int:
        """Requests that may be in the scheduler at once (running + queued)."""
        return self.max_running + self.max_waiting

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._left)

    def add(self, request: Request) -> None:
        """Queue a request; raises QueueFullError when the waiting queue is full."""
        if request.request_id in self._waiting or request.request_id in self._running:
            raise ValueError(f"duplicate request id {request.request_id}")
        if len(self._waiting) >= self.capacity - len(self._running):
            raise QueueFullError(
                f"server busy: {len(self._running)} requests running and "
                f"{len(self._waiting)} queued; retry shortly"
            )
        self._waiting[request.request_id] = request

    def ready_in(self, now: float) -> float:
        """Seconds before ``schedule`` admits anything (0: now).

        While nothing runs, requests arriving together are gathered until none
        came for ``gather_s``, and at most ``gather_max_s`` after the first of
        them, so a burst (an agent's parallel calls, a client's concurrent
        streams) prefills as one batch: otherwise the first request would
        prefill alone and every other one would wait for that step before its
        own prefill. Once something runs, step boundaries gather arrivals anyway.
        """
        if self._running or not self._waiting or self.gather_s <= 0:
            return 0.0
        arrivals = [r.arrival_s for r in self._waiting.values()]
        quiet = max(arrivals) + self.gather_s
        cap = min(arrivals) + self.gather_max_s
        return max(0.0, min(quiet, cap) - now)

    def schedule(
        self,
        memory: MemoryView,
        chunks: Sequence[PrefillChunk] = (),
        speculation: Sequence[PrefillChunk] = (),
        *,
        layout: RunnerLayout | None = None,
        now: float | None = None,
    ) -> SchedulerOutput:
        """Plan one step. ``chunks``: the prefill work the running requests have
        next (the runner's ``prefill_plan``); ``speculation``: the positions its
        decoding rows would verify beyond one (drafts), gated like a chunk;
        ``layout``: where the runner's requests run (default: an empty runner).

        While the running requests' KV (prompts plus output so far) is over the
        model's capacity, the newest is preempted. Waiting requests are admitted
        (``admit``, with ``memory.can_admit``), each with its cached tokens from
        the prefix index. Then the memory gate shapes the step's prefill chunks
        (theirs and the running ones'): capped, held, or, when a chunk does not
        fit even so, the newest running request gives way: a request admitted
        in this step goes back to the queue unstarted, an older one is preempted;
        only a request alone in the process whose chunk cannot fit is ended. An
        admitted prompt with images starts only if the gate passes its image encode
        (else it waits in the queue, or, alone in the process, is ended). The starting ones
        are placed (placement.py) on the runner without the leaving ones (those
        and the ones that finished since the last plan).
        """
        finished = self.take_left()
        preempted = self._preempt_over_capacity(memory)
        running = [c for c in chunks if c.request_id in self._running]
        # Short of KV this step (someone was preempted): nothing starts.
        admitted = [] if preempted else self._admit_gated(memory, running, now)
        cached = {r.request_id: memory.cached_tokens(r) for r in admitted}
        planned = running + [c for r in admitted if (c := self._first_chunk(r, cached))]
        shape, planned = self._gate(memory, planned, admitted, preempted)
        for rid in shape.ended:
            del self._running[rid]  # in the plan's ``ended``, not left for the next
        ended = (*shape.ended, *self._gate_encodes(memory, admitted, shape))
        started = tuple(r for r in admitted if r.request_id in self._running)
        drafts = tuple(c for c in speculation if c.request_id in self._running)
        speculate = memory.may_speculate(drafts, len(self._running))  # refused: plain decode
        leaving = (*finished, *preempted, *ended)
        return SchedulerOutput(
            admitted=started,
            cached={r.request_id: cached[r.request_id] for r in started},
            preempted=tuple(preempted),
            ended=ended,
            finished=finished,
            prefill_cap=shape.cap,
            openings=self._openings(memory, started, cached),
            speculate=speculate,
            placements=place(started, (layout or RunnerLayout()).without(leaving)),
            chunks=_passed([c for c in planned if c.request_id in self._running], shape),
            drafts=drafts if speculate else (),
        )

    def _admit_gated(
        self, memory: MemoryView, running: list[PrefillChunk], now: float | None
    ) -> list[Request]:
        """Waiting requests admitted through the memory view (what the running ones'
        chunks will still allocate counted)."""
        if not self._waiting:
            return []
        memory.start_admission(running, self.kv_load)
        return self.admit(memory.can_admit, now=now)

    def _openings(
        self, memory: MemoryView, started: Sequence[Request], cached: dict[str, int]
    ) -> tuple[SharedOpening, ...]:
        """The shared openings of the requests starting now (text prompts: images
        prefill on their own), each through the memory gate like a chunk; refused,
        its requests prefill the opening in their own gated chunks."""
        if not self.share_openings:
            return ()
        text = [r for r in started if not r.images]
        planned = plan_openings(text, cached, self.prefill_step_size)
        num_running = len(self._running)
        return tuple(o for o in planned if memory.may_share(o.num_tokens, o.start, num_running))

    def _preempt_over_capacity(self, memory: MemoryView) -> list[str]:
        """Preempt the newest while the running requests' KV passes the capacity
        (decoding grew it after admission) and more than one runs."""
        preempted: list[str] = []
        while len(self._running) > 1 and memory.kv_over_capacity(self.kv_load):
            victim = self.newest_running(exclude=self._with_images())
            if victim is None:
                break
            self._preempt(victim, "kv_capacity")
            preempted.append(victim)
        return preempted

    def _gate(
        self,
        memory: MemoryView,
        planned: list[PrefillChunk],
        admitted: list[Request],
        preempted: list[str],
    ) -> tuple[PrefillShape, list[PrefillChunk]]:
        """The memory gate's shape for the step's chunks, the newest giving way
        while a chunk does not fit and another request runs, here or in another
        model (the process's memory); and the chunks left."""
        shape = memory.shape_prefill(planned, len(self._running), self.kv_load)
        while shape.ended and (len(self._running) > 1 or memory.others_running()):
            victim = self._give_way(memory, admitted, preempted)
            if victim is None:
                break
            planned = [c for c in planned if c.request_id != victim]
            shape = memory.shape_prefill(planned, len(self._running), self.kv_load)
        memory.settle(shape, planned)
        return shape, planned

    def _gate_encodes(
        self, memory: MemoryView, admitted: list[Request], shape: PrefillShape
    ) -> tuple[str, ...]:
        """A prompt with images runs its vision tower when it starts: each admitted
        one's encode passes the memory gate first (never in a step that holds
        prefill). Refused, it goes back to the head of the queue unstarted while
        other work may free memory, or is ended when it is alone. Returns the ended."""
        ended: list[str] = []
        waiting: list[Request] = []
        for request in admitted:
            rid = request.request_id
            if request.images is None or rid not in self._running:
                continue
            verdict = "wait" if shape.held else memory.may_encode(request, len(self._running))
            if verdict == "run":
                continue
            state = self._running.pop(rid)
            if verdict == "end":
                ended.append(rid)
            else:
                waiting.append(state.request)
        for request in reversed(waiting):  # back at the head, in arrival order
            self._waiting[request.request_id] = request
            self._waiting.move_to_end(request.request_id, last=False)
        return tuple(ended)

    def _first_chunk(self, request: Request, cached: dict[str, int]) -> PrefillChunk | None:
        """An admitted request's first prefill chunk, as the runner will plan it
        (its last prompt token goes through the decode step; a one-forward prompt's
        whole rest goes in its first, indivisible, chunk)."""
        done = cached[request.request_id]
        left = request.num_prompt_tokens - done
        if left <= 1:
            return None
        if self._one_forward(request):
            return PrefillChunk(request.request_id, left, done + left, left, indivisible=True)
        n = min(self.prefill_step_size, left)
        return PrefillChunk(request.request_id, n, done + n, left)

    def _give_way(
        self, memory: MemoryView, admitted: list[Request], preempted: list[str]
    ) -> str | None:
        """The newest running request makes room: one admitted this step goes back
        to the queue unstarted, an older one is preempted. None: nothing can."""
        victim = self.newest_running(exclude=self._with_images())
        if victim is None:
            return None
        if any(r.request_id == victim for r in admitted):
            state = self._running.pop(victim)
            self._waiting[victim] = state.request
            self._waiting.move_to_end(victim, last=False)
            memory.sent_back(state.request)
        else:
            self._preempt(victim, "memory")
            preempted.append(victim)
        return victim

    def _with_images(self) -> set[str]:
        """Requests not preempted: a prompt with images cannot grow by its output
        (one still in its prompt resumes as it came, so it may give way)."""
        return {
            rid for rid, r in self._running.items() if r.request.images is not None and r.new_ids
        }

    def _preempt(self, victim: str, reason: str) -> None:
        resumed = self.preempt(victim)
        self.preemptions[reason] += 1
        log.warning(
            "preempt %s: %s goes back to the queue with %d output tokens (%s short); "
            "it resumes from the prefix cache",
            self.name,
            victim,
            resumed.num_resumed_tokens,
            "KV capacity" if reason == "kv_capacity" else "memory",
        )

    def admit(
        self, can_admit: AdmitCheck | None = None, *, now: float | None = None
    ) -> list[Request]:
        """Admit waiting requests in arrival order while running slots are free.

        ``can_admit(request, num_in_flight)`` may defer the head of the queue
        (memory admission): it stays queued, nothing behind it overtakes it, and
        it is asked again at the next call. Nothing is admitted while a burst is
        being gathered (``ready_in``; ``now`` defaults to the monotonic clock).
        Returns the newly admitted requests; the caller starts their prefill.
        """
        if self.ready_in(time.monotonic() if now is None else now) > 0:
            return []
        admitted = []
        while self._waiting and len(self._running) < self.max_running:
            request = next(iter(self._waiting.values()))
            if can_admit is not None and not can_admit(request, len(self._running)):
                break
            del self._waiting[request.request_id]
            self._running[request.request_id] = _Running.admit(request)
            admitted.append(request)
        return admitted

    def update_from_output(self, outputs: Iterable[TokenOutput]) -> list[RequestUpdate]:
        """Count produced tokens and decide finish reasons by token.

        Stop token ids finish with "stop" and are not visible; reaching
        ``max_tokens`` finishes with "length". Finished requests leave the
        running set, and the runner through the next plan. Outputs for requests
        no longer running are ignored (a runner may still produce one token for a
        request aborted this step).
        """
        updates = []
        for out in outputs:
            state = self._running.get(out.request_id)
            if state is None:
                continue
            state.num_output_tokens += 1
            state.new_ids.append(out.token_id)
            sampling = state.request.sampling
            is_stop = out.token_id in sampling.stop_token_ids
            if is_stop:
                status = RequestStatus.FINISHED_STOPPED
            elif state.num_output_tokens >= sampling.max_tokens:
                status = RequestStatus.FINISHED_LENGTH
            else:
                status = RequestStatus.RUNNING
            if status.is_finished:
                del self._running[out.request_id]
                self._left.append(out.request_id)
            updates.append(
                RequestUpdate(
                    out.request_id,
                    out.token_id,
                    not is_stop,
                    status,
                    state.num_output_tokens,
                    out.logprobs,
                )
            )
        return updates

    def finish(self, request_id: str, status: RequestStatus) -> RequestStatus | None:
        """End a request early (stop string, abort, error).

        Returns where it was (WAITING or RUNNING), or None if it is unknown or
        already finished. A running one leaves the runner through the next plan.
        """
        assert status.is_finished, status
        if self._waiting.pop(request_id, None) is not None:
            return RequestStatus.WAITING
        if self._running.pop(request_id, None) is not None:
            self._left.append(request_id)
            return RequestStatus.RUNNING
        return None

    def take_left(self) -> tuple[str, ...]:
        """The requests that left the running set since the last plan (the runner
        still holds them), now dropped from this list: the next plan's ``finished``,
        or the engine's between steps when the runner must be settled now."""
        left, self._left = tuple(self._left), []
        return left

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def running_ids(self) -> list[str]:
        return list(self._running)

    def newest_running(self, *, exclude: Container[str] = ()) -> str | None:
        """The running request that arrived last (a preemption's victim: the oldest
        keep their place), leaving out ``exclude``; None if there is none."""
        candidates = [r.request for rid, r in self._running.items() if rid not in exclude]
        if not candidates:
            return None
        return max(candidates, key=lambda r: r.arrival_s).request_id

    def requeue_running(self) -> list[str]:
        """Put every running request back at the head of the queue, oldest first
        (each resumes from its output so far, as a preempted one does). Returns
        those that cannot: a prompt with images that has output."""
        stuck = self._with_images()
        newest_first = sorted(self._running.values(), key=lambda r: -r.request.arrival_s)
        for state in newest_first:
            if state.request.request_id not in stuck:
                self.preempt(state.request.request_id)
        return sorted(stuck)

    def preempt(self, request_id: str) -> Request:
        """Put a running request back at the head of the queue, its output so far
        appended to its prompt (``Request.num_resumed_tokens``): it resumes from
        there (a prefix-cache hit when its blocks were stored) with the same
        output. Returns the request as it will resume."""
        state = self._running.pop(request_id)
        request = state.request
        resumed = dataclasses.replace(
            request,
            prompt_ids=request.prompt_ids + tuple(state.new_ids),
            num_resumed_tokens=state.num_output_tokens,
        )
        self._waiting[request_id] = resumed
        self._waiting.move_to_end(request_id, last=False)
        return resumed


def _passed(planned: Sequence[PrefillChunk], shape: PrefillShape) -> tuple[PrefillChunk, ...]:
    """The chunks the step runs, as the gate passed them: capped, none when held."""
    if shape.held:
        return ()
    kept = [c for c in planned if c.request_id not in shape.ended]
    if shape.cap is None:
        return tuple(kept)
    return tuple(dataclasses.replace(c, num_tokens=min(c.num_tokens, shape.cap)) for c in kept)
