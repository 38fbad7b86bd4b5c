"""One loaded model: tokenizer, scheduler and runner.

The event loop calls ``submit`` / ``abort`` and the tokenizing helpers; the MLX
worker thread calls ``step``. Events flow back through ``RequestStream``s, one
``call_soon_threadsafe`` per step and event loop.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from omlx.cache.prefix import PrefixCache
from omlx.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from omlx.engine.runner import OpeningGate, PrefillChunk
from omlx.engine.stream import RequestStream, StreamEvent, deliver
from omlx.engine.token_text import LogprobEntry, TokenText
from omlx.errors import (
    EngineError,
    InvalidRequestError,
    MemoryPressureError,
    OmlxError,
    QueueFullError,
    ServiceUnavailableError,
)
from omlx.grammar.processor import MAX_STEP_CPU_S
from omlx.memory import mlx_stats
from omlx.memory.budget import MemoryReading, prefill_step_transient_bytes
from omlx.memory.guard import MemoryGuard
from omlx.memory.probe import MemoryProbe
from omlx.memory.throttle import MAX_PREFILL_HOLD_S, PrefillShape, shape_prefill
from omlx.memory.vision import vision_transient_bytes
from omlx.models.loader import LoadedModel
from omlx.scheduler import Request, RequestStatus, RequestUpdate, Scheduler, TokenOutput
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)


class Runner(Protocol):
    @property
    def has_work(self) -> bool: ...
    def add(
        self, requests: list[Request], may_share: OpeningGate | None = None
    ) -> dict[str, int]: ...
    def prefill_plan(self) -> list[PrefillChunk]: ...
    def cap_prefill(self, cap: int | None) -> None: ...
    def remove(self, request_ids: list[str]) -> None: ...
    def step(self) -> list[TokenOutput]: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...


class Poster(Protocol):
    def post(self, fn: Any, *args: Any) -> None: ...
    def submit(self, fn: Any, *args: Any) -> Future: ...
    def busy_besides(self, engine: Any) -> bool: ...


@dataclass(slots=True)
class _Live:
    request: Request
    stream: RequestStream
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    num_cached_tokens: int = 0


class ModelEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        runner: Runner,
        scheduler: Scheduler,
        worker: Poster,
        *,
        context_window: int,
        guard: MemoryGuard,
        probe: MemoryProbe,
        prefix_cache: PrefixCache | None = None,
    ):
        self.loaded = loaded
        self.name = loaded.info.name
        self.tokenizer = loaded.tokenizer
        self.context_window = context_window
        self.guard = guard
        self.probe = probe
        # Set by the pool's enforcer above the soft limit: admit nothing new
        # while something runs (a lone request is still admitted, so no deadlock).
        self.admission_paused = False
        # Admission deferrals by reason: "memory", "kv_capacity", "paused".
        self.deferrals: Counter[str] = Counter()
        self.num_gated = 0
        # The gate's steps short of ending anything: MLX's cache handed back,
        # chunks capped, prefill waiting for decoding requests (since when).
        self.num_reclaims = 0
        self.num_throttled_steps = 0
        self.num_held_steps = 0
        self._held_since: float | None = None
        # Shared openings the gate held back (their requests prefilled them alone).
        self.num_unshared_openings = 0
        self._pending_bytes = 0
        self.prefix_cache = prefix_cache
        self._runner = runner
        self._scheduler = scheduler
        self._worker = worker
        self._live: dict[str, _Live] = {}
        # Front-door count of submitted, unfinished requests (event loop + MLX thread).
        self._lock = threading.Lock()
        self._num_in_flight = 0
        # Set (under _lock) when the engine stops taking requests: memory released
        # (until resume) or the model unloaded (for good, ``_closed``).
        self._refusal: OmlxError | None = None
        self._closed = False
        # Finished requests by reason ("stop", "length", "abort", "error", "rejected").
        self.finish_counts: Counter[str] = Counter()
        # Decoding runs on the MLX thread with its own tokenizer object so it
        # never shares a Rust tokenizer borrow with encoding on the event loop.
        self._decoder = _private_decoder(loaded.tokenizer)
        # Tokens as logprobs show them (MLX thread: it reads the private decoder).
        self.token_text = TokenText(self._decoder)
        self._grammar_lock = threading.Lock()
        self._grammar_compiler: Any = None

    def grammar_compiler(self) -> Any:
        """This model's GrammarCompiler, made on first use (not instant). Blocking:
        call through ``asyncio.to_thread``."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from omlx.grammar.compiler import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(
                    _hf_tokenizer(self.loaded.tokenizer),
                    self.loaded.vocab_size,
                    self.loaded.eos_token_ids,
                )
            return self._grammar_compiler

    # ---- event-loop side -------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def num_queued(self) -> int:
        """Submitted requests not admitted yet (waiting for a slot or for memory).
        Read off the MLX thread for metrics: a momentary count, never negative."""
        return max(0, self._num_in_flight - self._scheduler.num_running)

    def submit(self, request: Request, stream: RequestStream) -> None:
        """Queue a request. Raises PrefillMemoryExceededError for a prompt that can
        never fit under the memory limit, QueueFullError when at capacity."""
        self.submit_together([(request, stream)])

    def submit_together(self, pairs: list[tuple[Request, RequestStream]]) -> None:
        """Queue requests as one arrival, all or none: the MLX thread takes them in
        the same step, so the choices of one prompt (``n``) share its prefill."""
        for request, _ in pairs:
            self.guard.check_prefill(
                request.num_prompt_tokens, image_bytes=self._image_bytes(request)
            )
        with self._lock:
            if self._refusal is not None:
                raise copy.copy(self._refusal)
            if self._num_in_flight + len(pairs) > self._scheduler.capacity:
                raise QueueFullError(
                    f"model '{self.name}' is at capacity ({self._num_in_flight} requests "
                    "running or queued); retry shortly",
                    retry_after_s=1,
                )
            self._num_in_flight += len(pairs)
        self._worker.post(self._add_all, pairs)

    def abort(self, request_id: str) -> None:
        self._worker.post(self._abort, request_id)

    def run_on_mlx(self, fn: Any, *args: Any, even_if_closed: bool = False) -> Future:
        """Run ``fn(*args)`` on the MLX thread between steps (prompt scoring);
        refused like ``submit`` once the engine stops taking requests, unless
        ``even_if_closed`` (a clean-up)."""
        with self._lock:
            if self._refusal is not None and not even_if_closed:
                raise copy.copy(self._refusal)
        return self._worker.submit(fn, *args)

    def _image_bytes(self, request: Request) -> int:
        """The transient of encoding the request's images at prefill (0: none)."""
        vision = self.loaded.vision
        if request.images is None or vision is None:
            return 0
        shape = request.images.pixel_values.shape
        return vision_transient_bytes(vision.dims, shape, request.num_prompt_tokens)

    def refuse_new(self, error: OmlxError | None) -> None:
        """Refuse requests submitted from now on with ``error`` (None: take them
        again, unless closed). Requests already submitted are not touched."""
        with self._lock:
            if not self._closed:
                self._refusal = error

    def close(self, error: OmlxError) -> None:
        """Refuse every request from now on with ``error``: the model is going away.
        Any thread; the unload that follows ends what was submitted before."""
        with self._lock:
            self._refusal = error
            self._closed = True

    # ---- MLX thread --------------------------------------------------------
    @property
    def has_work(self) -> bool:
        # The runner's own work too: the prefix-cache stores of finished requests
        # run now, not at the start of the next request's prefill.
        return self._scheduler.has_work or self._runner.has_work

    @property
    def wait_s(self) -> float:
        """Seconds before a step would do anything: a burst of arrivals being
        gathered while idle (``Scheduler.ready_in``). 0: step now."""
        if self._runner.has_work:
            return 0.0
        return self._scheduler.ready_in(time.monotonic())

    def _add_all(self, pairs: list[tuple[Request, RequestStream]]) -> None:
        for request, stream in pairs:
            self._add(request, stream)

    def _add(self, request: Request, stream: RequestStream) -> None:
        # Closed and shut down already: nothing will step this engine again.
        gone = self._refusal if self._closed else None
        try:
            if gone is not None:
                raise copy.copy(gone)
            self._scheduler.add(request)
        except (OmlxError, ValueError) as exc:  # ValueError: a duplicate request id
            error = exc if isinstance(exc, OmlxError) else EngineError(f"not queued: {exc}")
            self._release("rejected")
            stream.loop.call_soon_threadsafe(stream.push, StreamEvent(error=error))
            return
        detok = IncrementalDetokenizer(self._decoder, request.prompt_ids)
        self._live[request.request_id] = _Live(
            request, stream, detok, StopStringMatcher(request.sampling.stop)
        )

    def _abort(self, request_id: str) -> None:
        where = self._scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if where is RequestStatus.RUNNING:
            self._runner.remove([request_id])
        if where is not None:
            self._live.pop(request_id, None)
            self._release("abort")

    def step(self) -> None:
        """Admit, run one batched step, turn tokens into stream events."""
        outbox: list[tuple[RequestStream, StreamEvent]] = []
        try:
            self._reclaim_near_limit()
            admitted = self._admit()
            cached = self._runner.add(admitted, self._gate_shared_opening)
            self._announce_admitted(admitted, cached)
            self._gate_prefill(outbox)
            outputs = self._runner.step()
        except Exception as exc:  # an MLX failure: fail what is running, keep serving
            log.exception("engine step failed for %s", self.name)
            # 503s pass as they are (a distributed rank lost: omlx/distributed/).
            unavailable = isinstance(exc, ServiceUnavailableError)
            self._fail_all(exc if unavailable else EngineError(f"generation failed: {exc}"), outbox)
        else:
            finished = []
            for update in self._scheduler.update_from_output(outputs):
                if update.request_id not in self._live:
                    # A step can carry two tokens of one request (the held first token
                    # and a decode); a stop string in the first ended it already.
                    continue
                reason = self._on_update(update, outbox)
                if reason is not None:
                    finished.append(update.request_id)
                    self._release(reason)
            self._runner.remove(finished)
            if finished:
                # Sample now: the peak of the work that just ended gets its own
                # time stamp and ages out of the recent window on schedule.
                self.probe.reading(fresh=True)
        self._flush(outbox)

    def _announce_admitted(self, admitted: list[Request], cached: dict[str, int]) -> None:
        """Record each admitted request's cached tokens, and tell the streams that
        asked its prompt split now, before its prefill (Anthropic's message_start)."""
        notices = []
        for request in admitted:
            live = self._live.get(request.request_id)
            if live is None:
                continue
            live.num_cached_tokens = cached.get(request.request_id, 0)
            if not live.stream.wants_admission:
                continue
            # The runner stores all of a prompt but its last token once it is in the cache.
            stored = request.num_prompt_tokens - 1 if self.prefix_cache is not None else 0
            event = StreamEvent(
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=live.num_cached_tokens,
                admitted=True,
                num_cache_written_tokens=max(0, stored - live.num_cached_tokens),
            )
            notices.append((live.stream, event))
        self._flush(notices)

    def _on_update(self, update: RequestUpdate, outbox: list) -> str | None:
        """Returns the finish reason when the request finished with this token."""
        live = self._live[update.request_id]
        if not update.status.is_finished and _grammar_overran(live.request):
            self._fail_request(update.request_id, _grammar_overrun_error(live.request), outbox)
            return None  # failed and released here
        text = live.detok.add(update.token_id) if update.visible else ""
        status = update.status
        if status.is_finished:
            text += live.detok.flush()
        text, stop_string = live.stops.feed(text)
        logprobs: tuple[LogprobEntry, ...] = ()
        if update.logprobs is not None and update.visible:
            logprobs = (self.token_text.entry(update.logprobs),)
        hit_stop = stop_string is not None
        if hit_stop:
            if not status.is_finished:
                self._scheduler.finish(update.request_id, RequestStatus.FINISHED_STOPPED)
            status = RequestStatus.FINISHED_STOPPED
        elif status.is_finished and not hit_stop:
            text += live.stops.flush()
        if text or status.is_finished or logprobs:
            outbox.append(
                (
                    live.stream,
                    StreamEvent(
                        text=text,
                        num_prompt_tokens=live.request.num_prompt_tokens,
                        num_output_tokens=update.num_output_tokens,
                        num_cached_tokens=live.num_cached_tokens,
                        finish_reason=status.finish_reason,
                        stop_string=stop_string,
                        logprobs=logprobs,
                    ),
                )
            )
        if status.is_finished:
            del self._live[update.request_id]
        return status.finish_reason

    def _admit(self) -> list[Request]:
        """Waiting requests that may start now (memory admission included)."""
        if not self._scheduler.num_waiting:
            return []
        # What admitted work will still allocate (KV to come, prefill step
        # transients): admission counts it, so requests admitted in one step
        # cannot stack past the limit.
        dims, extra = self.guard.dims, self.guard.unmodeled_bytes
        self._pending_bytes = sum(
            dims.kv_bytes_per_token * c.num_remaining
            + prefill_step_transient_bytes(dims, c.num_tokens, c.num_context_tokens)
            + extra
            for c in self._runner.prefill_plan()
        )
        return self._scheduler.schedule(self._can_admit)

    @property
    def num_deferrals(self) -> int:
        return self.deferrals.total()

    def guard_counters(self) -> dict[str, Any]:
        """What the memory guard did to this model's requests (admin API, /metrics)."""
        return {
            "deferrals": dict(self.deferrals),
            "gate_ended": self.num_gated,
            "throttled_steps": self.num_throttled_steps,
            "held_steps": self.num_held_steps,
            "reclaims": self.num_reclaims,
            "unshared_openings": self.num_unshared_openings,
        }

    def _can_admit(self, request: Request, num_running: int) -> bool:
        """Memory admission for the head of the queue (never defers a lone request)."""
        reason = None
        if num_running == 0:
            admitted = True
        elif self.admission_paused:
            admitted, reason = False, "paused"
            log.info(
                "memadmit %s: deferred a %d-token prompt: admission paused (memory above "
                "the soft limit) with %d in flight",
                self.name,
                request.num_prompt_tokens,
                num_running,
            )
        elif not self.guard.kv_fits(
            # The scheduler counts the ones admitted earlier in this step too.
            self._scheduler.num_running_tokens,
            request.num_prompt_tokens,
        ):
            admitted, reason = False, "kv_capacity"
            log.info(
                "memadmit %s: deferred a %d-token prompt: %d KV tokens in flight, capacity %s",
                self.name,
                request.num_prompt_tokens,
                self._scheduler.num_running_tokens,
                self.guard.max_kv_tokens,
            )
        else:
            # KV still to come for admitted requests, the step transients of every
            # request that will prefill in the same batch as this one, and the copy
            # of the decode batch's KV its rows make when this one joins them.
            pending = (
                self._pending_bytes
                + self._join_copy_bytes(request.num_prompt_tokens)
                + self._image_bytes(request)
            )
            reading = _plus(self.probe.reading(fresh=True), pending)
            admitted = self.guard.admit(request.num_prompt_tokens, num_running, reading)
            reason = None if admitted else "memory"
        if admitted:
            dims, n = self.guard.dims, request.num_prompt_tokens
            self._pending_bytes += dims.kv_bytes_per_token * n + (
                prefill_step_transient_bytes(dims, min(n, self.guard.chunk_tokens), n)
                + self.guard.unmodeled_bytes
            )
        else:
            self.deferrals[reason or "memory"] += 1
        return admitted

    def _gate_prefill(self, outbox: list) -> None:
        """Before this step's prefill chunks run: if they would take memory past
        the hard limit (a fresh reading; others grew), hand MLX's free cache
        back, then cap the chunks, then let prefill wait for decoding requests,
        and only then end the requests whose chunk still does not fit."""
        plan = self._runner.prefill_plan()
        if not plan:
            return
        shape, reading = self._shape_prefill(plan)
        if shape.cap is not None:
            mlx_stats.release_cache()  # freed buffers count until handed back
            self.num_reclaims += 1
            shape, reading = self._shape_prefill(plan)
        self._runner.cap_prefill(shape.cap)
        self._note_hold(shape.held)
        if shape.cap is not None:
            self._log_shape(shape, plan, reading)
        for rid in shape.ended:
            self.num_gated += 1
            self._fail_request(
                rid,
                MemoryPressureError(
                    "the server ended this request before its next prefill step: memory is "
                    f"at the {format_bytes(self.guard.limits.hard_bytes)} limit because of "
                    "other work; retry shortly, or send a shorter prompt"
                ),
                outbox,
            )

    def _reclaim_near_limit(self) -> None:
        """Within one margin of the hard limit, hand freed memory back before the
        step allocates: on the CPU backend freed heap pages stay in the footprint
        and would stack with the step's own transient (decode steps are not gated)."""
        reading, limits = self.probe.reading(fresh=True), self.guard.limits
        if reading.resident_bytes + limits.transient_margin_bytes > limits.hard_bytes:
            mlx_stats.release_cache()
            self.num_reclaims += 1

    def _join_copy_bytes(self, num_new_tokens: int) -> int:
        """Rows joining the decode batch extend its KV into new buffers: the old
        and the new batch are alive together for a moment."""
        tokens = self._scheduler.num_running_tokens + num_new_tokens
        return self.guard.dims.kv_bytes_per_token * tokens

    def _shape_prefill(self, plan: list[PrefillChunk]) -> tuple[PrefillShape, MemoryReading]:
        reading = self.probe.reading(fresh=True)
        others = self._scheduler.num_running > 1
        # Requests past their prompt: a row finishing its prompt joins (copies) their
        # batch; and they end and free their memory, so prefill may wait for them.
        decoding_here = self._scheduler.num_running > len(plan)
        if decoding_here and any(c.num_remaining <= c.num_tokens + 1 for c in plan):
            reading = _plus(reading, self._join_copy_bytes(0))
        decoding = decoding_here or self._worker.busy_besides(self)
        held_for = 0.0 if self._held_since is None else time.monotonic() - self._held_since
        shape = shape_prefill(
            plan,
            lambda tokens, cached: self.guard.gate(tokens, cached, reading, others=others),
            may_hold=decoding and held_for < MAX_PREFILL_HOLD_S,
        )
        return shape, reading

    def _note_hold(self, held: bool) -> None:
        if not held:
            self._held_since = None
        elif self._held_since is None:
            self._held_since = time.monotonic()

    def _log_shape(
        self, shape: PrefillShape, plan: list[PrefillChunk], reading: MemoryReading
    ) -> None:
        planned = max(c.num_tokens for c in plan)
        if shape.held:
            self.num_held_steps += 1
            what = "prefill waits a step for decoding requests to free memory"
        else:
            self.num_throttled_steps += 1
            what = f"prefill chunks capped at {shape.cap} tokens (planned {planned})"
        if shape.ended:
            what += f"; ending {', '.join(shape.ended)}: not even a {shape.cap}-token chunk fits"
        self._log_over_limit(what, reading)

    def _log_over_limit(self, what: str, reading: MemoryReading) -> None:
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

    def _gate_shared_opening(self, num_tokens: int, num_cached_tokens: int) -> bool:
        """The gate for a burst's shared opening (one row, run before the batch's
        chunks), with a fresh reading like every chunk's. Refused, nothing is ended:
        each request prefills the opening in its own chunks, gated one by one, so
        they are served if memory allows and ended by that gate if not."""
        reading = self.probe.reading(fresh=True)
        others = self._scheduler.num_running > 1
        if self.guard.gate(num_tokens, num_cached_tokens, reading, others=others):
            return True
        self.num_unshared_openings += 1
        self._log_over_limit(
            f"not sharing a {num_tokens}-token opening (its requests prefill it in their "
            "own gated chunks)",
            reading,
        )
        return False

    def _fail_request(self, request_id: str, error: OmlxError, outbox: list) -> None:
        where = self._scheduler.finish(request_id, RequestStatus.FINISHED_ERROR)
        if where is RequestStatus.RUNNING:
            self._runner.remove([request_id])
        live = self._live.pop(request_id, None)
        if where is not None:
            self._release("error")
        if live is not None:
            outbox.append((live.stream, StreamEvent(error=error)))

    def fail_all(self, error: OmlxError) -> int:
        """MLX thread: end every request with ``error`` (the enforcer above the hard
        limit, release of memory). Returns how many were ended."""
        outbox: list = []
        rids = list(self._live)
        for rid in rids:
            self._fail_request(rid, error, outbox)
        self._flush(outbox)
        return len(rids)

    def _fail_all(self, error: OmlxError, outbox: list) -> None:
        for rid, live in list(self._live.items()):
            if self._scheduler.finish(rid, RequestStatus.FINISHED_ERROR) is not None:
                self._release("error")
            outbox.append((live.stream, StreamEvent(error=error)))
        self._live.clear()
        self._runner.reset()

    def _release(self, reason: str) -> None:
        """MLX thread: one request left the engine."""
        with self._lock:
            self._num_in_flight -= 1
        self.finish_counts[reason] += 1

    @staticmethod
    def _flush(outbox: list[tuple[RequestStream, StreamEvent]]) -> None:
        by_loop: dict[Any, list] = defaultdict(list)
        for stream, event in outbox:
            by_loop[stream.loop].append((stream, event))
        for loop, batch in by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(deliver, batch)

    def shutdown(self) -> None:
        """MLX thread: abort everything and free the runner."""
        outbox: list = []
        gone = self._refusal if self._closed else None
        if gone is None:
            gone = unloaded_error(self.name, "the server is stopping")
            self.close(gone)
        for rid, live in list(self._live.items()):
            self._scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            self._release("abort")
            outbox.append((live.stream, StreamEvent(error=gone)))
        self._live.clear()
        self._runner.close()
        self._flush(outbox)


def unloaded_error(name: str, why: str) -> ServiceUnavailableError:
    """The retryable 503 for a request whose model went away (``why``: how)."""
    return ServiceUnavailableError(
        f"model '{name}' was unloaded ({why}); retry to load it again", retry_after_s=1
    )


def _hf_tokenizer(tokenizer: Any) -> Any:
    """A transformers fast tokenizer cloned from the public backend (xgrammar needs one)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise InvalidRequestError(
            "structured output needs a model with a fast (tokenizer.json) "
            "tokenizer; this model's tokenizer is not supported"
        )
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend.to_str()))


def _private_decoder(tokenizer: Any) -> Any:
    """A separate tokenizer object for decoding on the MLX thread."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return Tokenizer.from_str(backend.to_str())
    return tokenizer


def _grammar_overran(request: Request) -> bool:
    return request.grammar is not None and request.grammar.overrun.cpu_s is not None


def _grammar_overrun_error(request: Request) -> InvalidRequestError:
    return InvalidRequestError(
        f"the grammar needed {request.grammar.overrun.cpu_s:.2f} s of CPU to constrain one "
        f"token (limit {MAX_STEP_CPU_S} s), so the request was ended to keep the other "
        "requests' speed: the grammar is too ambiguous (e.g. a rule like 's ::= s s'); "
        "rewrite it so each prefix parses one way"
    )


def _plus(reading: MemoryReading, num_bytes: int) -> MemoryReading:
    """``reading`` with ``num_bytes`` more held (by MLX and so by the process)."""
    return dataclasses.replace(
        reading,
        mlx_active_bytes=reading.mlx_active_bytes + num_bytes,
        process_footprint_bytes=reading.process_footprint_bytes + num_bytes,
    )
