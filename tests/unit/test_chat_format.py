"""OpenAI chat bodies and stream chunks: reasoning and tool calls split out of content."""

from __future__ import annotations

import json

from omlx.api.formats import ChatFormat
from omlx.api.output_parser import (
    DEFAULT_TOOL_END,
    DEFAULT_TOOL_START,
    OutputParser,
    ToolMarkup,
    json_tool_call,
)
from omlx.engine.stream import StreamEvent


def run(pieces: list[str], parser: OutputParser, finish: str = "stop"):
    fmt = ChatFormat("chatcmpl-1", "m", [parser])
    chunks = []
    for i, text in enumerate(pieces):
        chunk = fmt.chunk(0, StreamEvent(text, num_prompt_tokens=5, num_output_tokens=i + 1))
        if chunk is not None:
            chunks.append(chunk)
    last = StreamEvent(num_prompt_tokens=5, num_output_tokens=len(pieces), finish_reason=finish)
    chunks.append(fmt.chunk(0, last))
    return chunks, fmt.body()


def deltas(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks)


def test_think_block_becomes_reasoning_content() -> None:
    pieces = ["<thi", "nk>Let me", " think.</th", "ink>\n\nThe answer", " is 4."]
    chunks, body = run(pieces, OutputParser())
    assert deltas(chunks, "reasoning_content") == "Let me think."
    assert deltas(chunks, "content") == "The answer is 4."
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "The answer is 4.",
        "reasoning_content": "Let me think.",
    }
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_template_opened_think_block() -> None:
    _, body = run(["hmm", "</think>", "ok"], OutputParser(starts_in_reasoning=True))
    assert body["choices"][0]["message"]["reasoning_content"] == "hmm"
    assert body["choices"][0]["message"]["content"] == "ok"


def test_tool_calls_in_stream_and_body() -> None:
    tools = ToolMarkup(DEFAULT_TOOL_START, DEFAULT_TOOL_END, json_tool_call)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    pieces = ["Sure. ", call[:15], call[15:40], call[40:]]
    chunks, body = run(pieces, OutputParser(tools=tools))
    assert deltas(chunks, "content") == "Sure. "
    streamed = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [(tc["index"], tc["function"]["name"]) for tc in streamed] == [(0, "add")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (tool_call,) = choice["message"]["tool_calls"]
    assert json.loads(tool_call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert tool_call["id"] == streamed[0]["id"]


def test_length_finish_is_kept_with_a_tool_call() -> None:
    tools = ToolMarkup(DEFAULT_TOOL_START, DEFAULT_TOOL_END, json_tool_call)
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    _, body = run([call], OutputParser(tools=tools), finish="length")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] is None
