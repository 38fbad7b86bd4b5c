"""How many tokens a request may generate: what it asked, within the room its prompt
leaves in the context window.

Coding agents send a fixed ``max_tokens`` (Claude Code and opencode: 32000) that a
user cannot change; refusing it would fail every turn on a model whose window is
smaller. So, like Ollama and LM Studio, the budget is clamped to the room left and
the response says so (``X-Omlx-Max-Tokens-Clamped``); only a prompt that leaves no
room is refused. A model's ``strict_max_tokens`` setting refuses instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omlx.errors import ContextLengthExceededError

if TYPE_CHECKING:
    from omlx.api.prompts import SamplingRequest

log = logging.getLogger(__name__)

CLAMPED_HEADER = "X-Omlx-Max-Tokens-Clamped"


@dataclass(frozen=True, slots=True)
class OutputBudget:
    """One prompt's output budget. ``requested`` is set only when the room left
    clamped what the request asked."""

    max_tokens: int
    window: int  # the context window the prompt and the output share
    num_prompt_tokens: int
    requested: int | None = None

    @property
    def clamped(self) -> bool:
        return self.requested is not None


def output_budget(
    name: str,
    window: int,
    num_prompt_tokens: int,
    req: SamplingRequest,
    default_max_tokens: int,
    strict: bool = False,
) -> OutputBudget:
    """The budget of one prompt of model ``name``; raises ContextLengthExceededError
    when the prompt leaves no room (or, with ``strict``, less than was asked)."""
    if req.context_limit is not None:
        window = min(window, req.context_limit)
    if num_prompt_tokens >= window:
        raise ContextLengthExceededError(
            f"the prompt is {num_prompt_tokens} tokens but the context window of "
            f"'{name}' is {window}; shorten the prompt{req.hint}",
            param=req.prompt_param,
        )
    room = window - num_prompt_tokens
    if req.max_tokens is None:
        return OutputBudget(min(default_max_tokens, room), window, num_prompt_tokens)
    if req.max_tokens <= room:
        return OutputBudget(req.max_tokens, window, num_prompt_tokens)
    if strict:
        raise ContextLengthExceededError(
            f"prompt ({num_prompt_tokens} tokens) + {req.max_tokens_param} ({req.max_tokens}) "
            f"exceeds the context window of {window}; set {req.max_tokens_param} to at most "
            f"{room}{req.hint} (this model's strict_max_tokens setting refuses what a "
            "clamp would serve)",
            param=req.max_tokens_param,
        )
    return OutputBudget(room, window, num_prompt_tokens, requested=req.max_tokens)


def clamped_header(request_id: str, budgets: Sequence[OutputBudget]) -> dict[str, str]:
    """The header (and a log line) naming the clamp; empty when nothing was clamped.
    Several prompts (a completions list): the tightest one speaks for all."""
    clamped = [b for b in budgets if b.clamped]
    if not clamped:
        return {}
    tightest = min(clamped, key=lambda b: b.max_tokens)
    value = (
        f"requested={tightest.requested}; granted={tightest.max_tokens}; "
        f"prompt_tokens={tightest.num_prompt_tokens}; context_window={tightest.window}"
    )
    log.info("%s: output budget clamped to the room left: %s", request_id, value)
    return {CLAMPED_HEADER: value}
