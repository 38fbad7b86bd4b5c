"""Requests as the scheduler sees them: frozen messages plus a status enum."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    # User stop ids plus the model's end-of-sequence ids; never shown as text.
    stop_token_ids: frozenset[int] = frozenset()
    # Logprobs of each sampled token plus this many top alternatives (None: none).
    logprobs: int | None = None
    # False: never decode speculatively (the request body's "speculative": false).
    speculative: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    # A grammar the output must follow (omlx.grammar.BoundGrammar), or None.
    grammar: Any = None
    arrival_s: float = field(default_factory=time.monotonic)
    # A vision model's images (omlx.api.images.PromptImages), encoded at prefill.
    images: Any = None
    # A preempted request resumes with its output so far appended to its prompt:
    # the last this many prompt tokens are output already produced (and counted).
    num_resumed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def resumed_output_ids(self) -> tuple[int, ...]:
        """The output a resumed request had produced before it was preempted."""
        n = self.num_resumed_tokens
        return self.prompt_ids[len(self.prompt_ids) - n :] if n else ()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the distribution it was sampled from, and
    the most likely tokens there, best first (ids and logprobs: plain Python)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One token a runner produced for a running request."""

    request_id: str
    token_id: int
    # Only for requests that asked (SamplingParams.logprobs).
    logprobs: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What the scheduler decided about one produced token."""

    request_id: str
    token_id: int
    # False for stop/end-of-sequence tokens: counted, never shown as text.
    visible: bool
    status: RequestStatus
    num_output_tokens: int
    logprobs: TokenLogprob | None = None
