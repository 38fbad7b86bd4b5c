"""Response objects and stream events of the OpenAI Responses API.

``ResponseFormat`` takes the engine's events, splits each through an OutputParser
(reasoning, visible text, tool calls) and keeps the output items; ``add`` returns
the stream events the step produced, in the documented order, each with the next
``sequence_number``. ``body`` is the response object at any point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from omlx.api.output_parser import OutputParser, ParsedDelta, ToolCall
from omlx.api.responses_input import Item, new_item_id
from omlx.engine.stream import StreamEvent
from omlx.errors import OmlxError

Event = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Echo:
    """The request settings a response object repeats back."""

    model: str
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text_format: dict[str, Any]
    reasoning_effort: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    truncation: str
    metadata: dict[str, str]
    store: bool
    previous_response_id: str | None

    def fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "instructions": self.instructions,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": {"format": self.text_format},
            "reasoning": {"effort": self.reasoning_effort, "summary": None},
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "truncation": self.truncation,
            "metadata": self.metadata,
            "store": self.store,
            "previous_response_id": self.previous_response_id,
            "background": False,
        }


class ResponseFormat:
    def __init__(
        self,
        response_id: str,
        echo: Echo,
        parser: OutputParser,
        namespaced: dict[str, tuple[str, str]] | None = None,
    ):
        self.response_id = response_id
        # A call's flat name -> (namespace, name) as the client declared the tool.
        self._namespaced = namespaced or {}
        self.created_at = int(time.time())
        self._echo = echo
        self._parser = parser
        self.output: list[Item] = []
        self._open: str | None = None  # "reasoning" or "message": the item taking deltas
        self._seq = -1
        self.status = "in_progress"
        self._error: dict[str, Any] | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self._num_reasoning_tokens = 0
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq, **fields}

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self.body()),
            self._event("response.in_progress", response=self.body()),
        ]

    def add(self, event: StreamEvent) -> list[Event]:
        """Record one engine event; the stream events it makes."""
        parsed = self._parser.feed(event.text)
        if event.finished:
            parsed = _joined(parsed, self._parser.finish())
        self.num_prompt_tokens = event.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens = event.num_output_tokens or self.num_output_tokens
        if parsed.reasoning:
            # Approximate: the tokens generated up to the last reasoning text.
            self._num_reasoning_tokens = self.num_output_tokens
        events = self._deltas(parsed)
        if event.finish_reason is not None:
            events += self._finish(event.finish_reason)
        return events

    def fail(self, error: OmlxError) -> list[Event]:
        """The error that ended generation, as an ``error`` event and response.failed."""
        self.status = "failed"
        self._error = {"code": "server_error", "message": error.message}
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=self.body()),
        ]

    def _deltas(self, parsed: ParsedDelta) -> list[Event]:
        events: list[Event] = []
        if parsed.reasoning:
            events += self._text_delta("reasoning", parsed.reasoning)
        if parsed.content:
            events += self._text_delta("message", parsed.content)
        for call in parsed.tool_calls:
            events += self._close() + self._function_call(call)
        return events

    def _text_delta(self, kind: str, text: str) -> list[Event]:
        events = [] if self._open == kind else self._close() + self._open_item(kind)
        item = self.output[-1]
        item["content"][0]["text"] += text
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, delta=text, content_index=0, **self._where(), **extra))
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open_item(self, kind: str) -> list[Event]:
        item: Item
        part: dict[str, Any]
        if kind == "message":
            item = {
                "id": new_item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "id": new_item_id("rs"),
                "type": "reasoning",
                "summary": [],
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self._open = kind
        added = self._event(
            "response.output_item.added", item=_copy(item), output_index=len(self.output) - 1
        )
        item["content"].append(part)
        part_added = self._event(
            "response.content_part.added", part=dict(part), content_index=0, **self._where()
        )
        return [added, part_added]

    def _close(self, status: str = "completed") -> list[Event]:
        """Close the item taking text deltas, if any."""
        if self._open is None:
            return []
        item, kind = self.output[-1], self._open
        self._open = None
        item["status"] = status
        part = item["content"][0]
        if kind == "message":
            done = self._event(
                "response.output_text.done",
                text=part["text"],
                logprobs=[],
                content_index=0,
                **self._where(),
            )
        else:
            done = self._event(
                "response.reasoning_text.done", text=part["text"], content_index=0, **self._where()
            )
        return [
            done,
            self._event(
                "response.content_part.done", part=dict(part), content_index=0, **self._where()
            ),
            self._event(
                "response.output_item.done", item=_copy(item), output_index=len(self.output) - 1
            ),
        ]

    def _function_call(self, call: ToolCall) -> list[Event]:
        item: Item = {
            "id": new_item_id("fc"),
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        if call.name in self._namespaced:
            item["namespace"], item["name"] = self._namespaced[call.name]
        self.output.append(item)
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", item=dict(item), output_index=index)]
        events.append(
            self._event(
                "response.function_call_arguments.delta", delta=call.arguments, **self._where()
            )
        )
        item["arguments"] = call.arguments
        item["status"] = "completed"
        events.append(
            self._event(
                "response.function_call_arguments.done",
                name=item["name"],
                arguments=call.arguments,
                **self._where(),
            )
        )
        events.append(self._event("response.output_item.done", item=dict(item), output_index=index))
        return events

    def _finish(self, finish_reason: str) -> list[Event]:
        self.finish_reason = finish_reason
        cut = finish_reason == "length"
        events = [] if self.output else self._open_item("message")  # always some output
        events += self._close("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        name = "response.incomplete" if cut else "response.completed"
        return [*events, self._event(name, response=self.body())]

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.num_prompt_tokens,
            # cache_write_tokens: OpenAI's paid cache writes; none here.
            "input_tokens_details": {
                "cached_tokens": self.num_cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": self.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": self._num_reasoning_tokens},
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
        }

    def body(self) -> dict[str, Any]:
        done = self.status in ("completed", "incomplete")
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self._error,
            "incomplete_details": incomplete,
            "output": [_copy(item) for item in self.output],
            "usage": self.usage() if done else None,
            **self._echo.fields(),
        }


def _copy(item: Item) -> Item:
    """A snapshot of an item (its content parts are mutated as text streams in)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out


def _joined(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    return ParsedDelta(
        a.content + b.content, a.reasoning + b.reasoning, a.tool_calls + b.tool_calls
    )
