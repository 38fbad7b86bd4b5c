"""Responses API stream events and response objects: reasoning, text and tool calls
split from the model's output, validated against the official openai types."""

from __future__ import annotations

import json
import typing

from openai.types.responses import Response, ResponseStreamEvent

from omlx.api.output_parser import (
    DEFAULT_TOOL_END,
    DEFAULT_TOOL_START,
    OutputParser,
    ToolMarkup,
    json_tool_call,
)
from omlx.api.responses_format import Echo, ResponseFormat
from omlx.engine.stream import StreamEvent
from omlx.errors import MemoryPressureError

# Each official event class by its "type" literal.
EVENTS = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
ECHO = Echo(
    model="m",
    instructions=None,
    tools=[],
    tool_choice="auto",
    parallel_tool_calls=True,
    text_format={"type": "text"},
    reasoning_effort="high",
    max_output_tokens=None,
    temperature=1.0,
    top_p=1.0,
    truncation="disabled",
    metadata={},
    store=True,
    previous_response_id=None,
)
TOOLS = ToolMarkup(DEFAULT_TOOL_START, DEFAULT_TOOL_END, json_tool_call)


def run(pieces: list[str], parser: OutputParser, finish: str = "stop") -> tuple[list, dict]:
    fmt = ResponseFormat("resp_1", ECHO, parser)
    events = fmt.start()
    for i, text in enumerate(pieces):
        events += fmt.add(StreamEvent(text, num_prompt_tokens=7, num_output_tokens=i + 1))
    last = StreamEvent(num_prompt_tokens=7, num_output_tokens=len(pieces), finish_reason=finish)
    events += fmt.add(last)
    for event in events:  # each one parses as the official event type
        EVENTS[event["type"]].model_validate(event)
    return events, fmt.body()


def test_reasoning_then_text_make_two_items_in_order() -> None:
    pieces = ["<think>Let me", " think.</think>", "\n\nThe answer", " is 4."]
    events, body = run(pieces, OutputParser())
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    response = Response.model_validate(body)
    reasoning, message = response.output
    assert message.type == "message" and message.status == "completed"
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
    assert response.output_text == "The answer is 4."
    assert response.usage.output_tokens_details.reasoning_tokens == 2
    assert response.usage.output_tokens == 4 and response.usage.input_tokens == 7
    assert events[-1]["response"] == body


def test_tool_calls_become_function_call_items() -> None:
    call = '{"name": "add", "arguments": {"a": 1}}'
    pieces = ["Sure.", DEFAULT_TOOL_START, call, DEFAULT_TOOL_END]
    events, body = run(pieces, OutputParser(tools=TOOLS))
    response = Response.model_validate(body)
    message, function_call = response.output
    assert message.content[0].text == "Sure."
    assert function_call.type == "function_call" and function_call.name == "add"
    assert json.loads(function_call.arguments) == {"a": 1}
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["arguments"] == function_call.arguments
    assert done[0]["item_id"] == function_call.id


def test_length_is_incomplete_and_nothing_is_an_empty_message() -> None:
    events, body = run(["Par"], OutputParser(), finish="length")
    assert events[-1]["type"] == "response.incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    _, body = run([], OutputParser())
    assert Response.model_validate(body).output_text == ""
    assert body["status"] == "completed"


def test_an_engine_error_is_an_error_event_and_response_failed() -> None:
    fmt = ResponseFormat("resp_1", ECHO, OutputParser())
    events = fmt.start() + fmt.add(StreamEvent("Hel", num_prompt_tokens=3, num_output_tokens=1))
    events += fmt.fail(MemoryPressureError("memory is at the limit"))
    for event in events:
        EVENTS[event["type"]].model_validate(event)
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "memory_pressure"
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == "memory is at the limit"
