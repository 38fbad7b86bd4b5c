"""One step's contract, as vLLM v1 and nano-vllm have it. Pure: no MLX.

``Scheduler.schedule(memory, chunks, speculation, layout=) -> SchedulerOutput``:
which requests start, which leave (preempted back to the queue, or ended by the
memory gate), their cached tokens from the pure prefix index, where each request
runs (solo, batch row, side, image side, fork: placement.py) and whether the solo
sequence moves, the shared openings they prefill once, each prefill chunk as the
gate passed it and the cap on them, and whether the decoding rows verify drafts.
``Runner.execute(plan) -> RunnerOutput``: the forward. The scheduler's
``update_from_output`` then decides what each produced token means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from omlx.errors import OmlxError
from omlx.memory.dims import allocated_columns
from omlx.memory.throttle import PrefillShape
from omlx.scheduler.openings import SharedOpening
from omlx.scheduler.placement import Placements
from omlx.scheduler.request import Request, TokenOutput

# The gate's answer on a prompt's image encode: run it now, wait (back to the queue
# while other work may free memory), or end the request (it is alone and cannot fit).
EncodeVerdict = Literal["run", "wait", "end"]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prefill work of one request in a step, as the memory gate sees it."""

    request_id: str
    num_tokens: int
    # Tokens the chunk attends over (cached + earlier chunks + this one).
    num_context_tokens: int
    # Prompt tokens still to prefill, this chunk included (KV yet to be allocated).
    num_remaining: int
    # It runs in one forward or not at all: a whole-prompt image prompt, which
    # mlx-vlm's model attends as one (Family.whole_prompt); the gate never caps it.
    indivisible: bool = False


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What the runner executes this step (frozen: the plan, not its outcome)."""

    # Requests starting now, in admission order.
    admitted: tuple[Request, ...] = ()
    # Prompt tokens of each admitted request the prefix index says are cached.
    cached: Mapping[str, int] = field(default_factory=dict)
    # Running requests put back at the head of the queue (they resume later).
    preempted: tuple[str, ...] = ()
    # Requests the memory gate ended (a lone request whose chunk, or image encode,
    # cannot fit now).
    ended: tuple[str, ...] = ()
    # Requests that finished since the last plan (by token or stop string, aborted,
    # failed): the runner still holds them.
    finished: tuple[str, ...] = ()
    # The most tokens any prefill chunk runs (None: as planned; 0: prefill waits).
    prefill_cap: int | None = None
    # Shared openings among the admitted requests (each prefilled once), gated.
    openings: tuple[SharedOpening, ...] = ()
    # Whether decoding rows may verify drafts this step (the memory gate's answer on
    # the verification width; False: plain decode).
    speculate: bool = True
    # Where every running and starting request runs, and the solo sequence's move.
    placements: Placements = field(default_factory=Placements)
    # The step's prefill chunks as the memory gate passed them (capped; held: none).
    # An admitted request's first chunk counts the prefix index's cached tokens.
    chunks: tuple[PrefillChunk, ...] = ()
    # The positions each drafting row verifies, as gated (empty: plain decode).
    drafts: tuple[PrefillChunk, ...] = ()

    @property
    def leaving(self) -> tuple[str, ...]:
        """Requests the runner drops before the step (their blocks go to the prefix
        cache at the start of its forward)."""
        return self.finished + self.preempted + self.ended


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What one executed step produced."""

    tokens: tuple[TokenOutput, ...] = ()
    # Prompt tokens each admitted request got from the prefix cache (restored).
    cached: Mapping[str, int] = field(default_factory=dict)
    # Admitted requests that could not start, and why (an image prompt its model
    # embedded wrong): they fail alone, the step goes on for the others.
    failed: Mapping[str, OmlxError] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KVLoad:
    """The running requests' KV as the runner's caches hold it. mlx-lm's
    ``BatchKVCache`` (``merge``/``extend``) left-pads every row to the longest, so a
    batch holds ``rows`` x ``longest`` token columns, not the sum of its requests'
    tokens (``tokens``): one long conversation beside short chats holds several
    times their sum; and every cache grows ``step`` columns at a time, so each row
    holds up to ``step`` more through a step (``allocated_columns``). Counted as one
    batch: the runner's batches and sequences hold no more. Conservative: padding and
    growth already allocated (so already in a memory reading) are priced again where
    admission adds what is still to come, so a request may wait earlier than it
    strictly must under a tight limit, never later."""

    rows: int = 0
    longest: int = 0
    tokens: int = 0
    # mlx-lm's cache growth step (its caches' ``step``, read where MLX is: the
    # engine's assembly); 1: no growth slack, the step's one token a row only.
    step: int = 1
    # Image states held for a row's whole life (mllama's cross-attention cache:
    # models/cross_attention.py), counted in state rows: the rows with images, each
    # zero-padded to the most (``most_states``), and their own sum (``states``).
    image_rows: int = 0
    most_states: int = 0
    states: int = 0

    @property
    def allocated(self) -> int:
        """The KV token columns the caches allocate: padding and growth included."""
        return self.rows * allocated_columns(self.longest, self.step)

    @property
    def held_states(self) -> int:
        """The image state rows the cross-attention cache holds: padding included."""
        return self.image_rows * self.most_states

    @property
    def leave_states(self) -> int:
        """The image state rows a row's leaving copies: the other rows with images,
        each padded to the most (the cache gathers them into a new array)."""
        return max(self.image_rows - 1, 0) * self.most_states

    def with_row(self, num_tokens: int, num_states: int = 0) -> KVLoad:
        """The load once a row of ``num_tokens`` (holding ``num_states`` image state
        rows) joins: the others padded to it."""
        return KVLoad(
            self.rows + 1,
            max(self.longest, num_tokens),
            self.tokens + num_tokens,
            self.step,
            self.image_rows + (num_states > 0),
            max(self.most_states, num_states),
            self.states + num_states,
        )


class MemoryView(Protocol):
    """What the scheduler asks about memory while it plans a step (the engine's
    StepGate answers from fresh readings and the model's guard). The running load
    comes with each question: the view holds no reference to the scheduler."""

    def kv_over_capacity(self, load: KVLoad) -> bool: ...
    def start_admission(self, chunks: Sequence[PrefillChunk], load: KVLoad) -> None: ...
    def can_admit(self, request: Request, num_running: int) -> bool: ...
    def cached_tokens(self, request: Request) -> int: ...
    def sent_back(self, request: Request) -> None: ...
    def shape_prefill(
        self, chunks: Sequence[PrefillChunk], num_running: int, load: KVLoad
    ) -> PrefillShape: ...
    def settle(self, shape: PrefillShape, chunks: Sequence[PrefillChunk]) -> None: ...
    def may_share(self, num_tokens: int, num_cached_tokens: int, num_running: int) -> bool: ...
    def may_speculate(self, chunks: Sequence[PrefillChunk], num_running: int) -> bool: ...
    def others_running(self) -> bool:
        """Whether other models' work runs in the process (a lone request here gives
        way to it instead of being ended)."""
        ...

    def may_encode(self, request: Request, num_running: int) -> EncodeVerdict: ...
