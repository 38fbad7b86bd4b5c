"""One loaded model: tokenizer, scheduler and runner.

The event loop calls ``submit`` / ``abort`` and the tokenizing helpers; the MLX
worker thread calls ``step``. Events flow back through ``RequestStream``s: per step and
event loop one ``call_soon_threadsafe`` for the step's events, after one for admission
notices when a stream asked for them.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from omlx.cache.hot import ClearTier
from omlx.cache.prefix import PrefixCache
from omlx.engine.admission import AdmissionSwitch
from omlx.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from omlx.engine.gate_inputs import (
    request_held_state_bytes,
    request_image_bytes,
    request_one_forward,
    step_gate,
)
from omlx.engine.stream import RequestStream, StreamEvent, deliver
from omlx.engine.token_text import LogprobEntry, TokenText
from omlx.engine.unbatched import serve_one_at_a_time
from omlx.errors import (
    EngineError,
    InvalidRequestError,
    MemoryPressureError,
    OmlxError,
    QueueFullError,
    ServiceUnavailableError,
)
from omlx.grammar.processor import MAX_STEP_CPU_S
from omlx.memory.guard import MemoryGuard
from omlx.memory.probe import MemoryProbe
from omlx.mlx_types import LanguageModel
from omlx.models.loader import LoadedModel
from omlx.models.model_settings import KVQuantSpec
from omlx.scheduler import Request, RequestStatus, RequestUpdate, Scheduler, TokenOutput
from omlx.scheduler.placement import RunnerLayout
from omlx.scheduler.plan import PrefillChunk, RunnerOutput, SchedulerOutput
from omlx.sizes import format_bytes

if TYPE_CHECKING:
    from omlx.engine.drafts import AttachedDraft
    from omlx.engine.worker import Steppable

# Events the MLX thread hands to their streams' event loops at the end of a step.
Outbox = list[tuple[RequestStream, StreamEvent]]

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine asks of its runner (runner.py's BatchRunner)."""

    @property
    def has_work(self) -> bool: ...
    def prefill_plan(self) -> list[PrefillChunk]: ...
    def layout(self) -> RunnerLayout: ...
    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...
    def remove(self, request_ids: list[str]) -> None: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...
    def speculative_stats(self) -> dict[str, int]: ...
    def speculation_plan(self) -> list[PrefillChunk]: ...
    def set_draft(self, model: LanguageModel | None, target_vocab: int) -> None: ...
    def clear_prefix_cache(self, tier: ClearTier) -> None: ...
    def flush_cache_stores(self) -> None: ...

    num_draft: int


class Poster(Protocol):
    def post(self, fn: Callable[..., Any], *args: Any) -> None: ...
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]: ...
    def running_besides(self, engine: Steppable | None) -> int: ...
    def progressing_besides(self, engine: Steppable | None) -> bool: ...
    def waiting_besides(self, engine: Steppable | None) -> float | None: ...
    def hold(self, holding: bool) -> None: ...


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
        admission: AdmissionSwitch | None = None,
    ):
        self.loaded = loaded
        self.name = loaded.info.name
        self.tokenizer = loaded.tokenizer
        self.context_window = context_window
        self.guard = guard
        self.probe = probe
        self.prefix_cache = prefix_cache
        self._runner = runner
        # The draft model proposing tokens (omlx.engine.drafts.AttachedDraft, or None).
        self.draft: AttachedDraft | None = None
        # Why this model serves one request at a time (None: it batches).
        self.unbatched: str | None = None
        # Its KV cache's quantization (quantized_cache.py; None: full precision).
        self.kv_quant: KVQuantSpec | None = None
        self._scheduler = scheduler
        self._worker = worker
        self._live: dict[str, _Live] = {}
        self.gate = step_gate(self, worker, admission or AdmissionSwitch())
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
                request.num_prompt_tokens,
                image_bytes=request_image_bytes(self.loaded.vision, self.guard, request),
                held_state_bytes=request_held_state_bytes(self.loaded.vision, request),
                one_forward=request_one_forward(self.loaded.vision, request),
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

    def run_on_mlx(
        self, fn: Callable[..., Any], *args: Any, even_if_closed: bool = False
    ) -> Future[Any]:
        """Run ``fn(*args)`` on the MLX thread between steps (prompt scoring);
        refused like ``submit`` once the engine stops taking requests, unless
        ``even_if_closed`` (a clean-up)."""
        with self._lock:
            if self._refusal is not None and not even_if_closed:
                raise copy.copy(self._refusal)
        return self._worker.submit(fn, *args)

    def hold_memory(self, holding: bool) -> None:
        """MLX thread: work outside the scheduler (prompt scoring) holds memory
        across turns; counted as work in flight (MLXWorker.hold)."""
        self._worker.hold(holding)

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
    def num_running(self) -> int:
        """Requests admitted and not finished (the worker counts the process's)."""
        return self._scheduler.num_running

    @property
    def stalled(self) -> bool:
        """Its last step's prefill all waited for memory, with nothing decoding."""
        return self.gate.stalled

    @property
    def waiting_for_memory_since(self) -> float | None:
        """The arrival time of the queue's head while memory admission defers it
        (and it is still waiting: not aborted, not admitted since)."""
        wait = self.gate.memory_wait
        if wait is None or not self._scheduler.is_waiting(wait[0]):
            return None
        return wait[1]

    @property
    def wait_s(self) -> float:
        """Seconds before a step would do anything: a burst of arrivals being
        gathered while idle (``Scheduler.ready_in``). 0: step now."""
        if self._runner.has_work:
            return 0.0
        return self._scheduler.ready_in(time.monotonic())

    @property
    def num_draft(self) -> int:
        """Tokens each request may draft per decode step (0: no speculation)."""
        return self._runner.num_draft

    @num_draft.setter
    def num_draft(self, value: int) -> None:
        self._runner.num_draft = value

    def speculative_stats(self) -> dict[str, int]:
        return self._runner.speculative_stats()

    def clear_prefix_cache(self, tier: ClearTier) -> None:
        """MLX thread: drop this model's cached blocks (on every rank of a split
        model), those of the requests that just ended included."""
        self._settle()
        self._runner.clear_prefix_cache(tier)

    def flush_cache_stores(self) -> None:
        """MLX thread: the prefix-cache stores of requests that ended, now."""
        self._settle()
        self._runner.flush_cache_stores()

    def _settle(self) -> None:
        """MLX thread, between steps: the runner drops now the requests that left
        since the last plan (a step's plan drops them; a flush, a clear, ending
        everything or an unload needs the runner as it will be)."""
        self._runner.remove(list(self._scheduler.take_left()))

    def use_draft(self, model: LanguageModel | None) -> None:
        """A draft model proposes this model's drafts from the next step (None:
        prompt lookup). MLX thread."""
        self._runner.set_draft(model, self.loaded.vocab_size)

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
        # A running request leaves the runner through the next plan.
        where = self._scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if where is not None:
            self._live.pop(request_id, None)
            self._release("abort")

    def step(self) -> None:
        """One step: the scheduler plans it (preemption, admission, the memory gate),
        the runner executes it, and its tokens become stream events."""
        outbox: Outbox = []
        try:
            self._store_before_reading()
            self.gate.reclaim_near_limit()
            runner = self._runner
            plan = self._scheduler.schedule(
                self.gate,
                runner.prefill_plan(),
                runner.speculation_plan(),
                layout=runner.layout(),
            )
            self._end_gated(plan.ended, outbox)
            output = self._runner.execute(plan)
        except Exception as exc:  # an MLX failure: fail what is running, keep serving
            log.exception("engine step failed for %s", self.name)
            # 503s pass as they are (a distributed rank lost: omlx/distributed/).
            error = (
                exc
                if isinstance(exc, ServiceUnavailableError)
                else EngineError(f"generation failed: {exc}")
            )
            if isinstance(error, EngineError) and self._batch_failed():
                self._go_one_at_a_time(exc, error, outbox)
            else:
                self._fail_all(error, outbox)
        else:
            for rid, failure in output.failed.items():
                self._fail_request(rid, failure, outbox)
            self._announce_admitted(plan.admitted, output.cached)
            self._update(list(output.tokens), outbox)
        self._flush(outbox)

    def _batch_failed(self) -> bool:
        """A step of several requests failed on a model that still batches."""
        return self.unbatched is None and self._scheduler.num_running > 1

    def _go_one_at_a_time(self, exc: Exception, error: OmlxError, outbox: Outbox) -> None:
        """The model cannot batch: its requests run one at a time from now on, the
        running ones resume from the queue (unbatched.py)."""
        self.unbatched, stuck = serve_one_at_a_time(self._scheduler, self.name, exc)
        for rid in stuck:
            self._fail_request(rid, error, outbox)
        self._runner.reset()
        self._scheduler.take_left()  # the reset dropped them

    def _store_before_reading(self) -> None:
        """The requests that finished since the last plan leave the runner, and every
        prefix-cache store owed so far runs, before the gate reads memory: a store
        turns a request's KV into RAM-tier bytes, which this step's reading must hold."""
        self._settle()
        self._runner.flush_cache_stores()

    def _end_gated(self, ended: Sequence[str], outbox: Outbox) -> None:
        """End the requests the memory gate ended (a lone request whose chunk
        cannot fit), before the forward."""
        for rid in ended:
            live = self._live.pop(rid, None)
            self._release("error")
            if live is not None:
                outbox.append((live.stream, StreamEvent(error=self._gated_error())))

    def _gated_error(self) -> MemoryPressureError:
        return MemoryPressureError(
            "the server ended this request before its next prefill step: memory is "
            f"at the {format_bytes(self.guard.limits.hard_bytes)} limit and no other "
            "request is running that would free it; retry shortly, or send a shorter prompt"
        )

    def _update(self, outputs: list[TokenOutput], outbox: Outbox) -> None:
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
        # The finished requests leave the runner through the next plan.
        if finished:
            # Sample now: the peak of the work that just ended gets its own
            # time stamp and ages out of the recent window on schedule.
            self.probe.reading(fresh=True)

    def _announce_admitted(self, admitted: Sequence[Request], cached: Mapping[str, int]) -> None:
        """Record each admitted request's cached tokens (as restored), and tell the
        streams that asked its prompt split (Anthropic's message_start): with its
        first prefill chunk's tokens, before any output."""
        notices = []
        for request in admitted:
            live = self._live.get(request.request_id)
            if live is None or request.num_resumed_tokens:
                continue  # a resumed request was announced when first admitted
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

    def _on_update(self, update: RequestUpdate, outbox: Outbox) -> str | None:
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

    @property
    def admission_paused(self) -> bool:
        return self.gate.admission_paused

    @property
    def num_deferrals(self) -> int:
        return self.gate.deferrals.total()

    @property
    def num_gated(self) -> int:
        return self.gate.num_gated

    def guard_counters(self) -> dict[str, Any]:
        """What the memory guard did to this model's requests (admin API, /metrics)."""
        return {**self.gate.counters(), "preempted": dict(self._scheduler.preemptions)}

    def _fail_request(self, request_id: str, error: OmlxError, outbox: Outbox) -> None:
        where = self._scheduler.finish(request_id, RequestStatus.FINISHED_ERROR)
        live = self._live.pop(request_id, None)
        if where is not None:
            self._release("error")
        if live is not None:
            outbox.append((live.stream, StreamEvent(error=error)))

    def fail_all(self, error: OmlxError) -> int:
        """MLX thread: end every request with ``error`` (the enforcer above the hard
        limit, release of memory). Returns how many were ended."""
        outbox: Outbox = []
        rids = list(self._live)
        for rid in rids:
            self._fail_request(rid, error, outbox)
        self._settle()  # their memory goes now, not at the next step
        self._flush(outbox)
        return len(rids)

    def _fail_all(self, error: OmlxError, outbox: Outbox) -> None:
        for rid, live in list(self._live.items()):
            if self._scheduler.finish(rid, RequestStatus.FINISHED_ERROR) is not None:
                self._release("error")
            outbox.append((live.stream, StreamEvent(error=error)))
        self._live.clear()
        self._runner.reset()
        self._scheduler.take_left()  # the reset dropped them

    def _release(self, reason: str) -> None:
        """MLX thread: one request left the engine."""
        with self._lock:
            self._num_in_flight -= 1
        self.finish_counts[reason] += 1

    @staticmethod
    def _flush(outbox: Outbox) -> None:
        by_loop: dict[Any, Outbox] = defaultdict(list)
        for stream, event in outbox:
            by_loop[stream.loop].append((stream, event))
        for loop, batch in by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(deliver, batch)

    def shutdown(self) -> None:
        """MLX thread: abort everything and free the runner."""
        outbox: Outbox = []
        gone = self._refusal if self._closed else None
        if gone is None:
            gone = unloaded_error(self.name, "the server is stopping")
            self.close(gone)
        # The requests that just ended leave first, so their blocks are stored at close.
        self._settle()
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
