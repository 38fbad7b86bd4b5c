"""OpenAI response bodies and stream chunks for chat and text completions."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from omlx.api.output_parser import OutputParser, ParsedDelta, ToolCall
from omlx.engine.stream import StreamEvent


@dataclass(slots=True)
class Choice:
    """One generated choice as it accumulates."""

    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, event: StreamEvent) -> None:
        self.text += event.text
        self.finish_reason = event.finish_reason or self.finish_reason
        self.num_prompt_tokens = event.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = event.num_output_tokens or self.num_output_tokens
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens


def usage_of(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.num_prompt_tokens for c in choices)
    output = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _Format:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, num_choices: int):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.choices = [Choice() for _ in range(num_choices)]
        self._started = [False] * num_choices

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
        return self._envelope(self.chunk_object_name, choices=[], usage=usage_of(self.choices))

    def body(self) -> dict[str, Any]:
        return self._envelope(
            self.object_name,
            usage=usage_of(self.choices),
            choices=[self._final_choice(i, c) for i, c in enumerate(self.choices)],
        )

    def _chunk_choice(self, index: int, event: StreamEvent, first: bool) -> dict | None:
        raise NotImplementedError

    def _final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(_Format):
    """Chat completions; each choice's text goes through an OutputParser that
    splits reasoning and tool calls out of the visible content."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, parsers: list[OutputParser]):
        super().__init__(response_id, model, len(parsers))
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
            "logprobs": None,
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
            "logprobs": None,
            "finish_reason": choice.finish_reason,
            "message": message,
        }


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
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, response_id: str, model: str, echoes: list[str]):
        super().__init__(response_id, model, len(echoes))
        self._echoes = echoes

    def _chunk_choice(self, index: int, event: StreamEvent, first: bool) -> dict | None:
        text = (self._echoes[index] if first else "") + event.text
        if not text and not event.finish_reason:
            return None
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": event.finish_reason,
        }

    def _final_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        return {
            "index": index,
            "text": self._echoes[index] + choice.text,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
        }
