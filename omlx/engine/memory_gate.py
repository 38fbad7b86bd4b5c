"""The memory guard at each step of one model's engine. MLX thread only.

Admission of the queue's head (``can_admit``), the forward gate on the step's
prefill chunks (``shape_prefill``: hand MLX's free cache back, cap the chunks,
hold prefill for decoding requests; the pure rules are in memory/throttle.py),
the gates of a burst's shared opening, of a speculative step and of a prompt's
image encode, and the KV-capacity check. It is the
``MemoryView`` the scheduler plans each step with (scheduler/plan.py), which
acts on the answers (preempts, ends); this module counts what the guard did
(admin API, /metrics) and writes the ``memadmit`` / ``memgate`` log lines.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omlx.engine.admission import AdmissionSwitch
from omlx.memory import mlx_stats
from omlx.memory.budget import MemoryReading, prefill_step_transient_bytes
from omlx.memory.guard import MemoryGuard
from omlx.memory.probe import MemoryProbe
from omlx.memory.throttle import PlannedChunk, PrefillShape, shape_prefill
from omlx.scheduler import Request
from omlx.scheduler.plan import EncodeVerdict, KVLoad
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)


class Elsewhere(Protocol):
    """The process's work besides this model's: other models' running requests and
    tasks holding memory (prompt scoring). Memory is the process's, so "alone" and
    "in flight" count them too (issue 40, defect 3)."""

    def running(self) -> int: ...
    def progressing(self) -> bool:
        """Whether some of that work goes on (it will end and free memory)."""
        ...

    def waiting_since(self) -> float | None:
        """The earliest arrival of another model's request memory admission defers."""
        ...


class StepGate:
    """``elsewhere``: the other models' work in flight. ``image_bytes``: the
    transient of encoding a request's images. ``held_states``: the image state
    rows a request then holds for its whole life (mllama's cross-attention states),
    ``state_row_bytes`` each. ``one_forward``: whether a request's prompt prefills in
    one forward (a whole-prompt image prompt), priced so. ``cached_tokens``: a prompt's
    tokens the prefix index holds (0 without a prefix cache). ``admission``: the
    pool's one admission switch (the enforcer pauses it above the soft limit)."""

    def __init__(
        self,
        name: str,
        guard: MemoryGuard,
        probe: MemoryProbe,
        *,
        elsewhere: Elsewhere,
        image_bytes: Callable[[Request], int],
        held_states: Callable[[Request], int] = lambda request: 0,
        one_forward: Callable[[Request], bool] = lambda request: False,
        state_row_bytes: int = 0,
        cached_tokens: Callable[[Request], int] = lambda request: 0,
        admission: AdmissionSwitch,
    ):
        self.name = name
        self.guard = guard
        self.probe = probe
        self._elsewhere = elsewhere
        self._image_bytes = image_bytes
        self._held_states = held_states
        self._one_forward = one_forward
        self._state_row_bytes = state_row_bytes
        self._cached_tokens = cached_tokens
        self._reading: MemoryReading | None = None  # the last shape's, for its log line
        # The pool's switch, set by its enforcer above the soft limit: admit nothing
        # new while something runs (a lone request is still admitted, so no deadlock).
        self._admission = admission
        # Admission deferrals by reason: "memory", "kv_capacity", "paused".
        self.deferrals: Counter[str] = Counter()
        # Requests the gate ended.
        self.num_gated = 0
        # The gate's steps short of ending anything: MLX's cache handed back,
        # chunks capped, prefill waiting for decoding requests.
        self.num_reclaims = 0
        self.num_throttled_steps = 0
        self.num_held_steps = 0
        # The last step held all prefill with nothing decoding here: this model
        # frees nothing until other work does (others do not wait for it).
        self.stalled = False
        self._decoding_here = False
        # Shared openings the gate held back (their requests prefilled them alone).
        self.num_unshared_openings = 0
        # Speculative steps the gate made decode without drafts.
        self.num_held_drafts = 0
        # The queue's head memory admission deferred (request id, arrival time):
        # other models admit nothing that arrived later until it starts.
        self.memory_wait: tuple[str, float] | None = None
        # Image encodes the gate did not let run (their requests waited or ended).
        self.num_held_encodes = 0
        self._pending_bytes = 0
        # The running requests' KV as admission goes (those admitted included), as
        # their caches hold it (rows padded to the longest, each grown a step at a
        # time: plan.KVLoad.allocated); and the tokens computed.
        self._load = KVLoad()
        self._computed_tokens = 0
        self._computed_states = 0

    @property
    def admission_paused(self) -> bool:
        return self._admission.paused

    def counters(self) -> dict[str, Any]:
        """What the memory guard did to this model's requests (admin API, /metrics;
        the engine adds the scheduler's preemptions)."""
        return {
            "deferrals": dict(self.deferrals),
            "gate_ended": self.num_gated,
            "throttled_steps": self.num_throttled_steps,
            "held_steps": self.num_held_steps,
            "reclaims": self.num_reclaims,
            "unshared_openings": self.num_unshared_openings,
            "held_drafts": self.num_held_drafts,
            "held_encodes": self.num_held_encodes,
        }

    # ---- before the step ----------------------------------------------------

    def reclaim_near_limit(self) -> None:
        """Within one margin of the hard limit, hand freed memory back before the
        step allocates: on the CPU backend freed heap pages stay in the footprint
        and would stack with the step's own transient (decode steps are not gated)."""
        reading, limits = self.probe.reading(fresh=True), self.guard.limits
        if reading.resident_bytes + limits.transient_margin_bytes > limits.hard_bytes:
            mlx_stats.release_cache()
            self.num_reclaims += 1

    def kv_over_capacity(self, load: KVLoad) -> bool:
        """The running requests' KV (prompts plus output so far, as the caches hold
        it; each row with a hybrid's fixed states and its image states) passed the
        model's KV capacity: decoding grew it after admission."""
        return not self._kv_fits(load)

    def _kv_fits(self, load: KVLoad) -> bool:
        """``load`` within the KV capacity, its held image states counted in KV tokens
        (as a hybrid's fixed states are: ``MemoryGuard.kv_tokens``)."""
        states = -(-self._states_bytes(load) // max(1, self.guard.dims.kv_bytes_per_token))
        return self.guard.kv_fits(load.allocated + states, 0, load.rows)

    def _states_bytes(self, load: KVLoad) -> int:
        """The image states ``load``'s rows hold (each zero-padded to the most)."""
        return load.held_states * self._state_row_bytes

    def cached_tokens(self, request: Request) -> int:
        return self._cached_tokens(request)

    # ---- admission ----------------------------------------------------------

    def start_admission(self, plan: Sequence[Any], load: KVLoad) -> None:
        """What admitted work will still allocate (KV to come, prefill step
        transients): admission counts it, so requests admitted in one step
        cannot stack past the limit. ``plan``: the runner's prefill chunks;
        ``load``: the running requests' KV as their caches hold it (padded, grown)."""
        guard, dims = self.guard, self.guard.dims
        self._load = load
        # KV the running rows hold now: at least their computed tokens (the
        # padding and growth already allocated are priced again below: conservative).
        self._computed_tokens = load.tokens - sum(c.num_remaining for c in plan)
        # Rows that run hold their image states already (their encode ran when they started).
        self._computed_states = load.states
        self._pending_bytes = sum(
            prefill_step_transient_bytes(dims, c.num_tokens, c.num_context_tokens)
            + guard.unmodeled_bytes
            + guard.batch_excess_bytes(c.num_tokens)
            for c in plan
        )

    def can_admit(self, request: Request, num_running: int) -> bool:
        """Memory admission for the head of the queue, ``num_running`` requests
        running here. Never defers a request alone in the process: nothing would
        end and free memory, so waiting could deadlock the queue."""
        in_flight = num_running + self._elsewhere.running()
        reason = None if in_flight == 0 else self._deferral(request, num_running, in_flight)
        if reason == "memory":
            self.memory_wait = (request.request_id, request.arrival_s)
        elif reason is None and self.memory_wait and self.memory_wait[0] == request.request_id:
            self.memory_wait = None
        if reason is None:
            guard, n = self.guard, request.num_prompt_tokens
            chunk = n if self._one_forward(request) else min(n, guard.chunk_tokens)
            self._pending_bytes += (
                prefill_step_transient_bytes(guard.dims, chunk, n)
                + guard.unmodeled_bytes
                + guard.batch_excess_bytes(chunk)
                + guard.dims.state_bytes(1)  # its fixed states, made by its first forward
            )
            self._load = self._load.with_row(n, self._held_states(request))
            return True
        self.deferrals[reason] += 1
        return False

    def _kv_to_come(self, load: KVLoad, num_new_tokens: int) -> int:
        """The KV ``load``'s batch will still allocate beyond what its rows computed,
        the padding of every row to the longest and the caches' growth step included
        (plan.KVLoad.allocated); less the newcomer's own
        ``num_new_tokens`` (the guard's estimate counts those)."""
        tokens = load.allocated - num_new_tokens - self._computed_tokens
        return self.guard.dims.kv_bytes(max(tokens, 0))

    def sent_back(self, request: Request) -> None:
        """A request admitted this step goes back to the queue unstarted: its first
        chunk does not fit beside the running ones (an admission deferral)."""
        self.deferrals["memory"] += 1
        log.info(
            "memadmit %s: deferred a %d-token prompt: its first prefill chunk does not "
            "fit beside the running requests' this step",
            self.name,
            request.num_prompt_tokens,
        )

    def _deferral(self, request: Request, num_running: int, in_flight: int) -> str | None:
        """Why the head of the queue waits ("paused", "kv_capacity", "memory"), or None.
        ``in_flight``: the process's running work (this model's ``num_running``)."""
        n, load, states = request.num_prompt_tokens, self._load, self._held_states(request)
        after = load.with_row(n, states)  # the batch once it joins: padded, grown (KVLoad)
        if self.admission_paused:
            log.info(
                "memadmit %s: deferred a %d-token prompt: admission paused (memory above "
                "the soft limit) with %d in flight",
                self.name,
                n,
                in_flight,
            )
            return "paused"
        earlier = self._elsewhere.waiting_since()
        if earlier is not None and earlier < request.arrival_s:
            log.info(
                "memadmit %s: deferred a %d-token prompt: another model's request that "
                "came first waits for memory",
                self.name,
                n,
            )
            return "memory"
        # The ones admitted earlier in this step count too.
        if not self._kv_fits(after):
            log.info(
                "memadmit %s: deferred a %d-token prompt: %d KV columns in flight (%d rows "
                "padded to %d tokens, grown %d at a time) and %s of image states, capacity %s",
                self.name,
                n,
                after.allocated,
                after.rows,
                after.longest,
                after.step,
                format_bytes(self._states_bytes(after)),
                self.guard.max_kv_tokens,
            )
            return "kv_capacity"
        # KV still to come for admitted requests (padded, grown), the step transients of
        # every request that will prefill in the same batch as this one, and the
        # copy of the decode batch's KV (and every row's fixed states, and image states
        # when a row with images joins: mlx-lm's ArraysCache and CrossAttentionStates
        # extend by concatenation too) its rows make when this one joins, and the
        # copy of the others' image states a row's leaving makes once it runs.
        join = self._join_copy_bytes(after, images=after.states > self._computed_states)
        kv = self._kv_to_come(after, n) + self._states_to_come(after, states)
        copies = join + after.leave_states * self._state_row_bytes
        pending = self._pending_bytes + kv + copies + self._image_bytes(request)
        reading = plus(self.probe.reading(fresh=True), pending)
        one_forward = self._one_forward(request)
        return None if self.guard.admit(n, in_flight, reading, one_forward) else "memory"

    def _states_to_come(self, load: KVLoad, num_new_states: int) -> int:
        """The image states ``load``'s rows will hold beyond those the running rows hold
        now: the rows admitted this step, and every row's padding to the most when a
        longer one joins; less the newcomer's own (its image price counts those)."""
        held = self._computed_states + num_new_states
        return max(self._states_bytes(load) - held * self._state_row_bytes, 0)

    def _join_copy_bytes(self, load: KVLoad, images: bool = True) -> int:
        """Rows joining the decode batch extend its KV (``load.allocated`` columns with
        theirs, every row padded to the longest and grown: plan.KVLoad.allocated) and
        each row's fixed states into new buffers, and, when a joining row has images
        (``images``; a row without keeps the batch's array), every row's image states,
        each padded to the most: the old and the new batch are alive together for a moment."""
        dims = self.guard.dims
        held = self._states_bytes(load) if images else 0
        return dims.kv_bytes(load.allocated) + dims.state_bytes(load.rows) + held

    # ---- the forward gate ---------------------------------------------------

    def shape_prefill(self, plan: Sequence[Any], num_running: int, load: KVLoad) -> PrefillShape:
        """What this step's prefill chunks may do under the hard limit (a fresh
        reading: others grew): as planned, capped, held, or some ended. Over the
        limit, MLX's free cache is handed back first and the plan shaped again.
        ``num_running`` requests run, holding ``load`` (their caches' KV columns, every
        row padded to the longest and grown, and their image states: plan.KVLoad)."""
        if not plan:
            return PrefillShape(None)
        shape = self._shape(plan, num_running, load)
        if shape.cap is not None:
            mlx_stats.release_cache()  # freed buffers count until handed back
            self.num_reclaims += 1
            shape = self._shape(plan, num_running, load)
        return shape

    def _shape(self, plan: Sequence[Any], num_running: int, load: KVLoad) -> PrefillShape:
        reading = self._reading = self.probe.reading(fresh=True)
        others = self._others_in_flight(num_running)
        # Requests past their prompt: a row finishing its prompt joins (copies) their
        # batch; and they end and free their memory, so prefill may wait for them.
        decoding_here = self._decoding_here = num_running > len(plan)
        if decoding_here and any(c.num_remaining <= c.num_tokens + 1 for c in plan):
            reading = plus(reading, self._join_copy_bytes(load))
        if decoding_here:  # a decoding row may leave: the others' image states copied
            reading = plus(reading, load.leave_states * self._state_row_bytes)
        # Prefill waits as long as other work goes on, however slow the machine: it
        # is ended only when nothing else could free memory (issue 40, defect 13).
        # Another model that waits for memory itself is no reason to wait: two
        # models would wait for each other.
        return shape_prefill(
            plan,
            lambda tokens, cached: self.guard.gate(tokens, cached, reading, others=others),
            may_hold=decoding_here or self._elsewhere.progressing(),
        )

    def _others_in_flight(self, num_running: int) -> bool:
        """Whether work besides one request runs in the process (so its recent peak
        may recur): this model's other rows, or another model's."""
        return num_running > 1 or self._elsewhere.running() > 0

    def others_running(self) -> bool:
        """Whether another model's requests (or a scoring task) run in the process: a
        lone request here whose chunk does not fit gives way to them (back to the
        queue) instead of being ended."""
        return self._elsewhere.running() > 0

    def settle(self, shape: PrefillShape, plan: Sequence[PlannedChunk]) -> None:
        """Record the shape the step runs with (and log it when it is not the plan)."""
        self.stalled = shape.held and not self._decoding_here
        if shape.cap is None or not plan or self._reading is None:
            return
        planned = max(c.num_tokens for c in plan)
        if shape.held:
            self.num_held_steps += 1
            what = "prefill waits a step for decoding requests to free memory"
        else:
            self.num_throttled_steps += 1
            what = f"prefill chunks capped at {shape.cap} tokens (planned {planned})"
        if shape.ended:
            self.num_gated += len(shape.ended)
            what += (
                f"; ending {', '.join(shape.ended)}: not even a {shape.cap}-token chunk "
                "(or a whole-prompt image prompt's one forward) fits"
            )
        self.log_over_limit(what, self._reading)

    def may_share(self, num_tokens: int, num_cached_tokens: int, num_running: int) -> bool:
        """The gate for a burst's shared opening (one row, run before the batch's
        chunks), with a fresh reading like every chunk's. Refused, nothing is ended:
        each request prefills the opening in its own chunks, gated one by one, so
        they are served if memory allows and ended by that gate if not."""
        reading = self.probe.reading(fresh=True)
        others = self._others_in_flight(num_running)
        if self.guard.gate(num_tokens, num_cached_tokens, reading, others=others):
            return True
        self.num_unshared_openings += 1
        self.log_over_limit(
            f"not sharing a {num_tokens}-token opening (its requests prefill it in their "
            "own gated chunks)",
            reading,
        )
        return False

    def may_speculate(self, plan: Sequence[PlannedChunk], num_running: int) -> bool:
        """The gate for a speculative step: its rows' verified positions (drafts
        and tokens accepted but not yet cached) as one chunk, with a fresh
        reading. Refused, the step decodes without drafts, which is never gated
        (seed 003: no engine path runs around the guard)."""
        if not plan:
            return True
        reading = self.probe.reading(fresh=True)
        tokens = sum(c.num_tokens for c in plan)
        cached = max(c.num_context_tokens - c.num_tokens for c in plan)
        others = self._others_in_flight(num_running)
        if self.guard.gate(tokens, cached, reading, others=others):
            return True
        self.num_held_drafts += 1
        self.log_over_limit(f"decoding without drafts ({tokens} positions)", reading)
        return False

    def may_encode(self, request: Request, num_running: int) -> EncodeVerdict:
        """The gate for a prompt's image encode (the vision tower runs when the
        request starts): its transient over a fresh reading, like a chunk's. Refused,
        the request waits while other work (here or on another model) may free
        memory, and is ended only alone in the process."""
        num_bytes = self._image_bytes(request)
        if not num_bytes:
            return "run"
        reading, limits = self.probe.reading(fresh=True), self.guard.limits
        added = num_bytes + self.guard.unmodeled_bytes
        peak = reading.resident_bytes + added + limits.transient_margin_bytes
        others = self._others_in_flight(num_running)
        if others:  # the recent peak may recur beside the encode (as in ``gate``)
            peak = max(peak, reading.recent_peak_bytes + added)
        if peak <= limits.hard_bytes:
            return "run"
        self.num_held_encodes += 1
        waits = others  # it holds nothing while it waits in the queue
        what = "waits for other work" if waits else "cannot run alone: ending its request"
        self.log_over_limit(f"a {format_bytes(num_bytes)} image encode {what}", reading)
        if waits:
            return "wait"
        self.num_gated += 1
        return "end"

    def log_over_limit(self, what: str, reading: MemoryReading) -> None:
        """The ``memgate`` line: what the gate did, and the numbers that made it."""
        log.warning(
            "memgate %s: %s: memory %s (recent peak %s) plus the forward and the %s margin "
            "would pass the %s limit",
            self.name,
            what,
            format_bytes(reading.resident_bytes),
            format_bytes(reading.recent_peak_bytes),
            format_bytes(self.guard.limits.transient_margin_bytes),
            format_bytes(self.guard.limits.hard_bytes),
        )


def plus(reading: MemoryReading, num_bytes: int) -> MemoryReading:
    """``reading`` with ``num_bytes`` more held (by MLX and so by the process)."""
    return dataclasses.replace(
        reading,
        mlx_active_bytes=reading.mlx_active_bytes + num_bytes,
        process_footprint_bytes=reading.process_footprint_bytes + num_bytes,
    )
