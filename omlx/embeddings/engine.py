"""One loaded embedding model: requests in, vectors (or pair scores) out.

The event loop calls ``submit``; the MLX worker thread calls ``step``, which
runs one padded batch of sequences from any number of requests. A step takes
the oldest waiting sequence's length bucket and fills the batch with sequences
of that bucket, so padding stays small. The engine offers the surface of
ModelEngine that the pool, enforcer, admin API and metrics read.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omlx.embeddings.inputs import Sequence
from omlx.embeddings.loader import EmbeddingModel
from omlx.errors import (
    EngineError,
    MemoryPressureError,
    OmlxError,
    PrefillMemoryExceededError,
    QueueFullError,
)
from omlx.memory.budget import Limits
from omlx.memory.probe import MemoryProbe
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)

# Padded tokens (batch x longest) and sequences in one forward step.
MAX_BATCH_TOKENS = 8192
MAX_BATCH_SEQUENCES = 64
# A step that does not fit while others hold memory waits this long before a retry.
HOLD_S = 0.05
_MIN_BUCKET = 16


@dataclass(eq=False, slots=True)
class _Job:
    sequences: list[Sequence]
    future: Future[Any]
    rows: list[Any] = field(default_factory=list)
    remaining: int = 0


@dataclass(frozen=True, slots=True)
class _Item:
    job: _Job
    index: int

    @property
    def length(self) -> int:
        return len(self.job.sequences[self.index].ids)


def bucket_of(length: int) -> int:
    """The power of two at or above ``length`` (at least 16): sequences batch by it."""
    bucket = _MIN_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


class EmbeddingGuard:
    """The memory check of an embedding step: the step's activations (estimated
    from the model's shape) must fit under the hard limit with what is held now."""

    profile = None  # no KV cache, so no auto-profile

    def __init__(self, name: str, config: dict[str, Any], limits: Limits):
        self.name = name
        self.limits = limits
        self.hidden = int(config.get("hidden_size") or 1024)
        self.heads = int(config.get("num_attention_heads") or 16)
        self.intermediate = int(config.get("intermediate_size") or 4 * self.hidden)

    def publish(self, limits: Limits) -> None:
        self.limits = limits

    def step_bytes(self, batch: int, length: int) -> int:
        """float32 activations of one layer (q, k, v, output, FFN) and attention scores."""
        per_token = 6 * self.hidden + 2 * self.intermediate
        return 4 * batch * length * (per_token + self.heads * length)

    def need_bytes(self, in_use_bytes: int, batch: int, length: int) -> int:
        return in_use_bytes + self.step_bytes(batch, length) + self.limits.transient_margin_bytes

    def fits(self, in_use_bytes: int, batch: int, length: int) -> bool:
        return self.need_bytes(in_use_bytes, batch, length) <= self.limits.hard_bytes

    def never_fits_error(self, baseline_bytes: int, length: int) -> PrefillMemoryExceededError:
        need = self.need_bytes(baseline_bytes, 1, length)
        return PrefillMemoryExceededError(
            f"embedding a {length}-token input needs about {format_bytes(need)} (with the "
            f"{format_bytes(baseline_bytes)} held when nothing runs), over the "
            f"{format_bytes(self.limits.hard_bytes)} memory limit; send shorter inputs, "
            "unload another model or raise memory.max_process_memory",
            estimated_bytes=need,
            limit_bytes=self.limits.hard_bytes,
            param="input",
        )

    def describe(self) -> str:
        return (
            f"memguard {self.name}: embedding model, hard limit "
            f"{format_bytes(self.limits.hard_bytes)}, step of {MAX_BATCH_TOKENS} padded tokens "
            f"needs about {format_bytes(self.step_bytes(MAX_BATCH_TOKENS // 512, 512))}"
        )


class EmbeddingEngine:
    prefix_cache = None  # nothing to reuse between requests

    def __init__(
        self,
        loaded: EmbeddingModel,
        worker: Any,
        *,
        guard: EmbeddingGuard,
        probe: MemoryProbe,
        capacity: int,
        baseline: Callable[[], int],
    ):
        self.loaded = loaded
        # What the process holds with nothing in flight (the pool's live baseline).
        self._baseline = baseline
        # A step that could not run yet waits until then (monotonic seconds).
        self._held_until = 0.0
        self.name = loaded.info.name
        self.tokenizer = loaded.tokenizer
        self.context_window = loaded.native_context
        self.guard = guard
        self.probe = probe
        self.capacity = capacity
        self.num_deferrals = 0
        self.num_gated = 0
        # Steps whose batch the guard halved to fit under the hard limit.
        self.num_throttled_steps = 0
        self.finish_counts: Counter[str] = Counter()
        self.steps = 0
        self.sequences_done = 0
        # Most requests whose sequences shared one step (concurrent requests batch).
        self.max_requests_in_step = 0
        self._worker = worker
        self._pending: deque[_Item] = deque()
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._refusal: OmlxError | None = None
        self._closed = False

    # ---- event-loop side -------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def num_queued(self) -> int:
        return max(0, self._num_in_flight - 1)

    def guard_counters(self) -> dict[str, Any]:
        """The memory guard's counters, with the keys of an LLM engine's (admin API,
        /metrics); an embedding step has no admission queue, chunks, openings, drafts
        or preemption."""
        return {
            "deferrals": {},
            "gate_ended": self.num_gated,
            "preempted": {},
            "throttled_steps": self.num_throttled_steps,
            "held_steps": 0,
            "reclaims": 0,
            "unshared_openings": 0,
            "held_drafts": 0,
            "held_encodes": 0,
        }

    def batch_stats(self) -> dict[str, int]:
        return {
            "steps": self.steps,
            "sequences": self.sequences_done,
            "max_requests_in_step": self.max_requests_in_step,
        }

    def submit(self, sequences: list[Sequence]) -> Future[Any]:
        """Queue the sequences of one request; the future holds a (n, D) float32
        array (or (n,) pair scores for a cross-encoder) in input order. Raises
        PrefillMemoryExceededError (400) for an input that could not fit even alone."""
        longest = max((bucket_of(len(seq.ids)) for seq in sequences), default=0)
        if longest and not self.guard.fits(self._baseline(), 1, longest):
            raise self.guard.never_fits_error(self._baseline(), longest)
        with self._lock:
            if self._refusal is not None:
                raise copy.copy(self._refusal)
            if self._num_in_flight >= self.capacity:
                raise QueueFullError(
                    f"model '{self.name}' is at capacity ({self._num_in_flight} requests "
                    "running or queued); retry shortly",
                    retry_after_s=1,
                )
            self._num_in_flight += 1
        job = _Job(sequences, Future(), [None] * len(sequences), len(sequences))
        job.future.add_done_callback(self._finished)
        self._worker.post(self._add, job)
        return job.future

    def _finished(self, future: Future[Any]) -> None:
        with self._lock:
            self._num_in_flight -= 1
        reason = "abort" if future.cancelled() else "error" if future.exception() else "stop"
        self.finish_counts[reason] += 1

    def refuse_new(self, error: OmlxError | None) -> None:
        with self._lock:
            if not self._closed:
                self._refusal = error

    def close(self, error: OmlxError) -> None:
        with self._lock:
            self._refusal = error
            self._closed = True

    # ---- MLX thread --------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._pending)

    @property
    def wait_s(self) -> float:
        return max(0.0, self._held_until - time.monotonic())

    @property
    def num_running(self) -> int:
        """For the other models' gates (worker.py): none, since a batch's memory lives
        only within its own step and nothing is held across turns."""
        return 0

    @property
    def stalled(self) -> bool:
        return False

    @property
    def waiting_for_memory_since(self) -> float | None:
        return None  # no admission queue: each batch waits in its own step

    def _add(self, job: _Job) -> None:
        if self._closed and self._refusal is not None:
            _settle(job, error=copy.copy(self._refusal))
            return
        if not job.sequences:
            _settle(job, result=np.zeros((0, self.loaded.spec.dimension), np.float32))
            return
        self._pending.extend(_Item(job, i) for i in range(len(job.sequences)))

    def step(self) -> None:
        """One forward pass over a batch of same-bucket sequences."""
        batch = self._take_batch()
        if not batch:
            return
        length = max(item.length for item in batch)
        in_use = self.probe.reading(fresh=True).in_use_bytes
        if len(batch) > 1 and not self.guard.fits(in_use, len(batch), length):
            self.num_throttled_steps += 1
        while len(batch) > 1 and not self.guard.fits(in_use, len(batch), length):
            self._pending.extendleft(reversed(batch[len(batch) // 2 :]))
            batch = batch[: len(batch) // 2]
        if not self.guard.fits(in_use, 1, length):
            self._gate(batch[0], in_use, length)
            return
        try:
            rows = self._forward(batch, length)
        except Exception as exc:  # the batch's requests end with the reason; others go on
            log.exception("embedding step of %s failed", self.name)
            for job in {id(item.job): item.job for item in batch}.values():
                _settle(job, error=EngineError(f"embedding failed in model '{self.name}': {exc}"))
            return
        self._deliver(batch, rows)

    def _deliver(self, batch: list[_Item], rows: np.ndarray) -> None:
        """Each row to its request; a request whose last row came is answered."""
        self.steps += 1
        self.sequences_done += len(batch)
        self.max_requests_in_step = max(self.max_requests_in_step, len({id(i.job) for i in batch}))
        for item, row in zip(batch, rows, strict=True):
            job = item.job
            job.rows[item.index] = row
            job.remaining -= 1
            if job.remaining == 0:
                _settle(job, result=np.stack(job.rows))

    def _take_batch(self) -> list[_Item]:
        """The oldest live sequence's bucket, filled with later sequences of that bucket."""
        while self._pending and self._pending[0].job.future.done():
            self._pending.popleft()  # its request ended (client gone, or failed)
        if not self._pending:
            return []
        bucket = bucket_of(self._pending[0].length)
        per_batch = min(MAX_BATCH_SEQUENCES, max(1, MAX_BATCH_TOKENS // bucket))
        batch: list[_Item] = []
        rest: deque[_Item] = deque()
        for item in self._pending:
            fits = len(batch) < per_batch and bucket_of(item.length) == bucket
            if fits and not item.job.future.done():
                batch.append(item)
            elif not item.job.future.done():
                rest.append(item)
        self._pending = rest
        return batch

    def _forward(self, batch: list[_Item], length: int) -> np.ndarray:
        import mlx.core as mx

        from omlx.embeddings.bert import pool

        ids = np.full((len(batch), length), self.loaded.pad_id, np.int32)
        types = np.zeros((len(batch), length), np.int32)
        attention = np.zeros((len(batch), length), np.int32)
        for row, item in enumerate(batch):
            seq = item.job.sequences[item.index]
            ids[row, : len(seq.ids)] = seq.ids
            types[row, : len(seq.type_ids)] = seq.type_ids
            attention[row, : len(seq.ids)] = 1
        mask = mx.array(attention)
        hidden = self.loaded.encoder(mx.array(ids), mx.array(types), mask)
        if self.loaded.head is not None:
            out = _pair_scores(self.loaded.head(hidden, mask))
        else:
            out = pool(hidden, mask, self.loaded.spec.pooling)
            if self.loaded.spec.normalize:
                out = out / mx.maximum(mx.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return np.array(out.astype(mx.float32))

    def _gate(self, item: _Item, in_use: int, length: int) -> None:
        """Not even one sequence fits now. If it fits alone, others (any model's) hold
        the memory: it waits for them. If not even alone (the baseline grew since it
        was admitted), its request ends with the 400 the front door gives."""
        baseline = self._baseline()
        if self.guard.fits(baseline, 1, length):
            self.num_deferrals += 1
            self._pending.appendleft(item)
            self._held_until = time.monotonic() + HOLD_S
            log.info(
                "memguard %s: a %d-token step waits: %s in use, limit %s",
                self.name,
                length,
                format_bytes(in_use),
                format_bytes(self.guard.limits.hard_bytes),
            )
            return
        self.num_gated += 1
        log.warning("memguard %s: a %d-token input no longer fits at all", self.name, length)
        _settle(item.job, error=self.guard.never_fits_error(baseline, length))

    def fail_all(self, error: OmlxError) -> int:
        """MLX thread: end every waiting request with ``error``; how many."""
        jobs = {id(item.job): item.job for item in self._pending}
        self._pending.clear()
        for job in jobs.values():
            _settle(job, error=copy.copy(error))
        return len(jobs)

    def shutdown(self) -> None:
        error = self._refusal or MemoryPressureError(f"model '{self.name}' was unloaded")
        self.fail_all(error)


def _pair_scores(logits: Any) -> Any:
    """A cross-encoder's relevance: sigmoid of a single logit, else the last class's
    probability (sentence-transformers' CrossEncoder does the same; an LLM reranker's
    head gives [no, yes], so this is P(yes))."""
    import mlx.core as mx

    if logits.shape[-1] == 1:
        return mx.sigmoid(logits[:, 0])
    return mx.softmax(logits, axis=-1)[:, -1]


def _settle(job: _Job, *, result: Any = None, error: BaseException | None = None) -> None:
    if job.future.done():
        return
    if error is not None:
        job.future.set_exception(error)
    else:
        job.future.set_result(result)


def make_embedding_engine(
    info: Any,
    worker: Any,
    limits: Limits,
    probe: MemoryProbe,
    capacity: int,
    baseline: Callable[[], int],
) -> EmbeddingEngine:
    """MLX thread: load the folder and wrap it in an engine under the pool's limits."""
    from omlx.embeddings.loader import load_embedding_model

    loaded = load_embedding_model(info)
    guard = EmbeddingGuard(info.name, loaded.config, limits)
    return EmbeddingEngine(
        loaded, worker, guard=guard, probe=probe, capacity=capacity, baseline=baseline
    )
