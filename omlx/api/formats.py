"""OpenAI response bodies and stream chunks for chat and text completions."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from omlx.api.encoder import Encoder
from omlx.api.errors import omlx_error_body
from omlx.api.output_parser import OutputParser, ParsedDelta, ToolCall
from omlx.api.sse import DONE, KEEPALIVE, sse_data
from omlx.engine.stream import StreamEvent
from omlx.engine.token_text import LogprobEntry
from omlx.errors import OmlxError


@dataclass(slots=True)
class Choice:
    """One generated choice as it accumulates."""

    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # Every token's logprobs, and those no chunk carried yet (streaming).
    logprobs: list[LogprobEntry] = field(default_factory=list)
    unsent: list[LogprobEntry] = field(default_factory=list)

    def add(self, event: StreamEvent) -> None:
        self.logprobs.extend(event.logprobs)
        self.unsent.extend(event.logprobs)
        self.text += event.text
        self.finish_reason = event.finish_reason or self.finish_reason
        self.num_prompt_tokens = event.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = event.num_output_tokens or self.num_output_tokens
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens

    def take_unsent(self) -> list[LogprobEntry]:
        out, self.unsent = self.unsent, []
        return out


def usage_of(choices: list[Choice], per_prompt: int = 1) -> dict[str, Any]:
    """Usage of the choices; with ``per_prompt`` > 1 (``n``), each run of that many
    choices shares one prompt, counted once (as OpenAI counts it)."""
    firsts = choices[::per_prompt]
    prompt = sum(c.num_prompt_tokens for c in firsts)
    output = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _Format:
    object_name = ""
    chunk_object_name = ""

    def __init__(
        self, response_id: str, model: str, num_choices: int, *, n: int = 1, logprobs: bool = False
    ):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.choices = [Choice() for _ in range(num_choices)]
        self._started = [False] * num_choices
        # Choices per prompt (the request's ``n``) and whether logprobs were asked.
        self.n = n
        self.logprobs = logprobs

    def usage(self) -> dict[str, Any]:
        return usage_of(self.choices, self.n)

    def _envelope(self, object_name: str, **fields: Any) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            **fields,
        }

    def chunk(self, index: int, event: StreamEvent) -> dict[str, Any] | None:
        """Record the event; the stream chunk to send for it, if any."""
        self.choices[index].add(event)
        first = not self._started[index]
        self._started[index] = True
        choice = self._chunk_choice(index, event, first)
        if choice is None:
            return None
        return self._envelope(self.chunk_object_name, choices=[choice])

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name, choices=[], usage=self.usage())

    def body(self) -> dict[str, Any]:
        return self._envelope(
            self.object_name,
            usage=self.usage(),
            choices=[self._final_choice(i, c) for i, c in enumerate(self.choices)],
        )

    def _chunk_choice(self, index: int, event: StreamEvent, first: bool) -> dict[str, Any] | None:
        raise NotImplementedError

    def _final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(_Format):
    """Chat completions; each choice's text goes through an OutputParser that
    splits reasoning and tool calls out of the visible content."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self, response_id: str, model: str, parsers: list[OutputParser], *, logprobs: bool = False
    ):
        super().__init__(response_id, model, len(parsers), n=len(parsers), logprobs=logprobs)
        self._parsers = parsers
        self._parts = [_ChatParts() for _ in parsers]

    def chunk(self, index: int, event: StreamEvent) -> dict[str, Any] | None:
        parser, parts = self._parsers[index], self._parts[index]
        parsed = parser.feed(event.text)
        if event.finished:
            parsed = _joined(parsed, parser.finish())
        parts.add(parsed)
        if event.finish_reason == "stop" and parts.tool_calls:
            event = dataclasses.replace(event, finish_reason="tool_calls")
        event = dataclasses.replace(event, text=parsed.content)
        self.choices[index].add(event)
        first = not self._started[index]
        self._started[index] = True
        delta: dict[str, Any] = {"role": "assistant", "content": parsed.content} if first else {}
        if parsed.content and not first:
            delta["content"] = parsed.content
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            start = len(parts.tool_calls) - len(parsed.tool_calls)
            delta["tool_calls"] = [
                {"index": start + i, **_tool_call_json(call)}
                for i, call in enumerate(parsed.tool_calls)
            ]
        if not delta and not event.finish_reason:
            return None
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": self._chat_logprobs(self.choices[index].take_unsent()),
            "finish_reason": event.finish_reason,
        }
        return self._envelope(self.chunk_object_name, choices=[choice])

    def _final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        parts = self._parts[index]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parts.content if parts.content or not parts.tool_calls else None,
        }
        if parts.reasoning:
            message["reasoning_content"] = parts.reasoning
        if parts.tool_calls:
            message["tool_calls"] = [_tool_call_json(c) for c in parts.tool_calls]
        return {
            "index": index,
            "logprobs": self._chat_logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason,
            "message": message,
        }

    def _chat_logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [_chat_entry(e, top=True) for e in entries], "refusal": None}


def _chat_entry(entry: LogprobEntry, *, top: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.bytes),
    }
    if top:
        out["top_logprobs"] = [_chat_entry(t, top=False) for t in entry.top]
    return out


@dataclass(slots=True)
class _ChatParts:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, parsed: ParsedDelta) -> None:
        self.content += parsed.content
        self.reasoning += parsed.reasoning
        self.tool_calls.extend(parsed.tool_calls)


def _joined(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    return ParsedDelta(
        a.content + b.content, a.reasoning + b.reasoning, a.tool_calls + b.tool_calls
    )


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class CompletionFormat(_Format):
    """Text completions: one choice per prompt and ``n``, prompt-major (choice
    ``p * n + j`` is prompt p's j-th); with ``echo`` the prompt text (and, with
    logprobs, its tokens' logprobs) comes first."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(
        self,
        response_id: str,
        model: str,
        echoes: list[str],
        *,
        n: int = 1,
        logprobs: bool = False,
        prompt_logprobs: list[list[LogprobEntry]] | None = None,
    ):
        super().__init__(response_id, model, len(echoes) * n, n=n, logprobs=logprobs)
        self._echoes = echoes
        self._prompt_logprobs = prompt_logprobs
        # Characters of each choice's text so far (the next token's text_offset).
        self._offsets = [0] * len(self.choices)

    def _echo(self, index: int) -> str:
        return self._echoes[index // self.n]

    def _head_logprobs(self, index: int) -> list[LogprobEntry]:
        """The prompt's entries (echo + logprobs), before the choice's own."""
        if self._prompt_logprobs is None:
            return []
        return self._prompt_logprobs[index // self.n]

    def _chunk_choice(self, index: int, event: StreamEvent, first: bool) -> dict[str, Any] | None:
        text = (self._echo(index) if first else "") + event.text
        if not text and not event.finish_reason:
            return None
        entries = self.choices[index].take_unsent()
        if first:
            entries = self._head_logprobs(index) + entries
            self._offsets[index] = self._first_offset(index)
        logprobs = self._completion_logprobs(entries, self._offsets[index])
        self._offsets[index] += sum(len(e.token) for e in entries)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": event.finish_reason,
        }

    def _final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        entries = self._head_logprobs(index) + choice.logprobs
        return {
            "index": index,
            "text": self._echo(index) + choice.text,
            "logprobs": self._completion_logprobs(entries, self._first_offset(index)),
            "finish_reason": choice.finish_reason,
        }

    def _first_offset(self, index: int) -> int:
        """Where the first entry's text starts: after an echo that has no entries."""
        return 0 if self._prompt_logprobs is not None else len(self._echo(index))

    def _completion_logprobs(
        self, entries: list[LogprobEntry], start: int
    ) -> dict[str, Any] | None:
        """OpenAI's legacy shape: parallel lists, the top alternatives as a dict
        that also holds the chosen token (so up to logprobs + 1 entries)."""
        if not self.logprobs:
            return None
        offsets = list(itertools.accumulate((len(e.token) for e in entries[:-1]), initial=start))
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_top_dict(e) for e in entries],
            "text_offset": offsets if entries else [],
        }


def _top_dict(entry: LogprobEntry) -> dict[str, float] | None:
    if entry.logprob is None:
        return None  # the first prompt token: nothing predicts it
    top = {t.token: t.logprob for t in entry.top if t.logprob is not None}
    top.setdefault(entry.token, entry.logprob)
    return top


class OpenAIEncoder(Encoder):
    """Chat and text completions on the wire: SSE ``data:`` chunks ending in ``[DONE]``
    (after the usage chunk when asked), or the whole body."""

    def __init__(self, fmt: _Format, *, include_usage: bool = False):
        self.fmt = fmt
        self.include_usage = include_usage

    def frames(self, index: int, event: StreamEvent) -> list[str]:
        chunk = self.fmt.chunk(index, event)
        return [sse_data(chunk)] if chunk is not None else []

    def error_frames(self, error: OmlxError) -> list[str]:
        return [sse_data(omlx_error_body(error)), DONE]

    def keepalive(self) -> str | None:
        return KEEPALIVE

    def closing(self) -> list[str]:
        usage = [sse_data(self.fmt.usage_chunk())] if self.include_usage else []
        return [*usage, DONE]

    def body(self) -> dict[str, Any]:
        return self.fmt.body()
