"""Apply one request's grammar to its logits inside the batch. MLX thread only."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from omlx.mlx_types import item_int

log = logging.getLogger(__name__)

_TABLES: dict[Any, mx.array] = {}

# Draws a request's next token from (1, V) logits, as its sampler would.
Draw = Callable[[mx.array], int]
_DRAW_STREAM = 0x6772616D6D6172  # "grammar"
# CPU seconds of matcher work one request may take in one step, well above a
# normal step's (benchmarks/README.md, "Figures behind design choices"); an
# ambiguous grammar's grows with every token (an Earley parse) and, on the MLX
# thread, would slow every request in the batch.
MAX_STEP_CPU_S = 0.05


def _byte_table(dtype: Any) -> mx.array:
    """(256, 8): for each byte value, 0 where the bit is set and -inf where not."""
    table = _TABLES.get(dtype)
    if table is None:
        bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1
        table = mx.array(np.where(bits == 1, 0.0, -np.inf), dtype=dtype)
        _TABLES[dtype] = table
    return table


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """Logits (1, V) with -inf where xgrammar's int32 bitmask (1, ceil(V/32)) is 0."""
    as_bytes = mx.array(bitmask.view(np.uint8))
    additive = _byte_table(logits.dtype)[as_bytes].reshape(1, -1)
    return logits + additive[:, : logits.shape[-1]]


class GrammarLogitsProcessor:
    """mlx-lm logits processor holding one request's grammar matcher.

    mlx-lm passes the context ending with the token just fed to the model. From
    the second call on, that token is the previous sample: it is accepted into
    the matcher before the next mask is computed.

    With ``draw`` (greedy or plain-temperature requests), a fast path: the
    model's own pick is drawn from the unmasked logits and offered to the
    matcher first; only when the grammar refuses it is the full vocabulary
    mask computed (far dearer than checking one token: benchmarks/README.md,
    "Figures behind design choices").
    An accepted pick is then the only token left in the logits, so the
    request's sampler returns exactly it. The output distribution is the
    masked one: the argmax of masked logits is the unmasked argmax whenever
    the grammar allows it, and for temperature sampling this is rejection
    sampling (P(t) = p(t) + (1 - Z) p(t) / Z = p(t) / Z for an allowed t,
    Z the allowed mass). Top-p/top-k/min-p cut by the unmasked distribution
    would not be exact, so those requests always take the mask.
    """

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        *,
        draw: Draw | None = None,
        stop_token_ids: tuple[int, ...] = (),
        overrun: StepOverrun | None = None,
    ):
        self._matcher = matcher
        words = (vocab_size + 31) // 32
        self._bitmask = np.zeros((1, words), dtype=np.int32)
        self._first = True
        self._draw = draw
        self._ahead: int | None = None  # a choice already accepted (fast path)
        self._stop_ids = stop_token_ids
        # Set once a step's matcher work went over MAX_STEP_CPU_S: the request ends.
        self.overrun = overrun if overrun is not None else StepOverrun()
        self._step_cpu_s = 0.0
        self.num_fills = 0
        self.num_fast = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.overrun.cpu_s is not None:
            return _only(logits, *self._stop_ids)
        self._step_cpu_s = 0.0
        out = self._constrain(tokens, logits)
        if self._step_cpu_s > MAX_STEP_CPU_S and self._stop_ids:
            log.warning(
                "grammar step took %.2f s of CPU (limit %.2f s): ending the request so "
                "the batch keeps its speed; the grammar is too ambiguous",
                self._step_cpu_s,
                MAX_STEP_CPU_S,
            )
            self.overrun.cpu_s = self._step_cpu_s
        return out

    def _constrain(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if not self._first:
            self._timed(self._accept_previous, item_int(tokens[-1]))
        self._first = False
        if self._matcher.is_terminated():
            return logits  # only stop tokens remain; the request is ending
        if self._draw is not None:
            choice = self._draw(logits)
            if self._timed(self._matcher.accept_token, choice):
                self._ahead = choice
                self.num_fast += 1
                return _only(logits, choice)
        else:
            # Start the forward pass now: the CPU-side bitmask fill then overlaps
            # the model compute instead of idling the device.
            mx.async_eval(logits)
        self._timed(self._matcher.fill_next_token_bitmask, self._bitmask)
        self.num_fills += 1
        return apply_bitmask(logits, self._bitmask)

    def replay(self, tokens: Sequence[int]) -> None:
        """Accept output a resumed (preempted) request produced before: its next
        mask continues the grammar from there."""
        for token in tokens:
            if not self._matcher.is_terminated():
                self._matcher.accept_token(token)

    def _timed(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)``, its CPU time (this thread only: not the model's) counted."""
        start = time.thread_time()
        try:
            return work(*args)
        finally:
            self._step_cpu_s += time.thread_time() - start

    def _accept_previous(self, token: int) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if token == ahead:
                return  # accepted when it was chosen
            # Something after us changed the pick: undo the choice, take the sample.
            log.warning("grammar fast path: sampled %d, expected %d", token, ahead)
            self._matcher.rollback(1)
        if not self._matcher.is_terminated() and not self._matcher.accept_token(token):
            log.warning("grammar rejected sampled token %d", token)


def greedy_draw(logits: mx.array) -> int:
    return item_int(mx.argmax(logits, axis=-1))


def temperature_draw(temperature: float, seed: int | None) -> Draw:
    """Draws from softmax(logits / temperature) with its own PRNG key (a seed
    reproduces the same draws whatever else is in the batch)."""
    # Another stream than the request's sampler (which starts at key(seed)).
    seed = (seed ^ _DRAW_STREAM) % 2**64 if seed is not None else secrets.randbits(63)
    key = mx.random.key(seed)
    inv_temp = 1.0 / temperature

    def draw(logits: mx.array) -> int:
        nonlocal key
        key, sub = mx.random.split(key)
        return item_int(mx.random.categorical(logits * inv_temp, key=sub))

    return draw


def _only(logits: mx.array, *tokens: int) -> mx.array:
    """``logits`` with every entry but ``tokens`` at -inf."""
    ids = mx.arange(logits.shape[-1])
    keep = ids == tokens[0]
    for token in tokens[1:]:
        keep = keep | (ids == token)
    return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))


@dataclass(slots=True)
class StepOverrun:
    """Shared by a request's grammar and its processor: the processor sets it when
    one step's matcher work passed MAX_STEP_CPU_S, and the engine then ends the
    request with an error (its output so far may not yet satisfy the grammar)."""

    cpu_s: float | None = None


@dataclass(frozen=True, slots=True)
class BoundGrammar:
    """A compiled grammar and the compiler that makes matchers for it.

    Requests carry this; the runner asks it for a fresh processor per request.
    """

    compiled: Any
    compiler: Any  # omlx.grammar.compiler.GrammarCompiler
    overrun: StepOverrun = field(default_factory=StepOverrun)

    def new_processor(self, *, draw: Draw | None = None) -> GrammarLogitsProcessor:
        return GrammarLogitsProcessor(
            self.compiler.matcher(self.compiled),
            self.compiler.vocab_size,
            draw=draw,
            stop_token_ids=self.compiler.stop_token_ids,
            overrun=self.overrun,
        )
