"""Anthropic Messages <-> chat pipeline conversion (omlx.api.anthropic_format); no model."""

from __future__ import annotations

import json

import pytest

from omlx.api.anthropic_format import (
    MessageFormat,
    chat_messages,
    chat_tools,
    output_grammar,
    sampling_request,
    server_tools,
    stop_reason,
    template_kwargs,
    tool_constraint,
    uses_cache_control,
)
from omlx.api.anthropic_schemas import MessagesRequest
from omlx.api.errors import anthropic_error_body
from omlx.api.output_parser import (
    DEFAULT_TOOL_END,
    DEFAULT_TOOL_START,
    OutputParser,
    ToolMarkup,
    json_tool_call,
)
from omlx.engine.stream import StreamEvent
from omlx.errors import InvalidRequestError

TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def request(**kw) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**body, **kw})


def tool_parser() -> OutputParser:
    return OutputParser(tools=ToolMarkup(DEFAULT_TOOL_START, DEFAULT_TOOL_END, json_tool_call))


def run(events: list[StreamEvent], stops: tuple[str, ...] = ()) -> tuple[list, MessageFormat]:
    fmt = MessageFormat("msg_1", "m", tool_parser(), num_prompt_tokens=10, stop_sequences=stops)
    frames = fmt.start()
    for event in events:
        frames += fmt.add(event)
    return frames, fmt


def tokens(
    *texts: str, finish: str = "stop", cached: int = 0, stop: str | None = None
) -> list[StreamEvent]:
    events = [
        StreamEvent(t, num_prompt_tokens=10, num_output_tokens=i + 1, num_cached_tokens=cached)
        for i, t in enumerate(texts)
    ]
    events.append(
        StreamEvent(
            num_prompt_tokens=10,
            num_output_tokens=len(texts) + 1,
            num_cached_tokens=cached,
            finish_reason=finish,
            stop_string=stop,
        )
    )
    return events


# ---- requests --------------------------------------------------------------------


def test_system_string_and_blocks_come_first() -> None:
    assert chat_messages(request(system="Be brief.")) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    blocks = [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    assert chat_messages(request(system=blocks))[0] == {"role": "system", "content": "A\nB"}


def test_system_messages_join_the_system_prompt_in_order() -> None:
    messages = [
        {"role": "system", "content": "B"},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "C"}]},
    ]
    assert chat_messages(request(system="A", messages=messages)) == [
        {"role": "system", "content": "A\nB\nC"},
        {"role": "user", "content": "hi"},
    ]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].content\[0\]"):
        chat_messages(request(messages=[{"role": "system", "content": [{"type": "image"}]}]))


CACHED = {"cache_control": {"type": "ephemeral"}}


@pytest.mark.parametrize(
    "where",
    [
        {"system": [{"type": "text", "text": "A", **CACHED}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", **CACHED}]}]},
        {"tools": [{**TOOL, **CACHED}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "sunny", **CACHED}],
                        }
                    ],
                }
            ]
        },
        CACHED,  # on the request itself
    ],
)
def test_cache_control_is_seen_anywhere(where: dict) -> None:
    assert uses_cache_control(request(**where))


def test_no_cache_control_is_no_cache_writes() -> None:
    assert not uses_cache_control(request(system=[{"type": "text", "text": "A"}], tools=[TOOL]))


@pytest.mark.parametrize("reports", [True, False])
def test_usage_splits_the_prompt_from_the_admission_notice(reports: bool) -> None:
    fmt = MessageFormat(
        "msg_1", "m", tool_parser(), num_prompt_tokens=10, reports_cache_writes=reports
    )
    admitted = StreamEvent(
        num_prompt_tokens=10, num_cached_tokens=3, admitted=True, num_cache_written_tokens=6
    )
    assert fmt.add(admitted) == []
    [(name, start), _] = fmt.start()
    written = 6 if reports else 0
    expected = {
        "input_tokens": 10 - 3 - written,
        "output_tokens": 0,
        "cache_read_input_tokens": 3,
        "cache_creation_input_tokens": written,
    }
    assert name == "message_start" and start["message"]["usage"] == expected
    frames = []
    for event in tokens("Hi", cached=3):
        frames += fmt.add(event)
    assert frames[-2][1]["usage"] == {**expected, "output_tokens": 2}


def test_multi_turn_text_blocks_and_dropped_thinking() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "two"},
            ],
        },
        {"role": "user", "content": "three"},
    ]
    assert chat_messages(request(messages=messages)) == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "P"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"type": "text", "text": "thanks"},
            ],
        },
    ]
    out = chat_messages(request(messages=messages))
    call = out[1]["tool_calls"][0]
    assert out[1]["role"] == "assistant" and out[1]["content"] == "Checking."
    assert call["id"] == "toolu_1" and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "P"}
    assert out[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "a\nb"},
        {"role": "user", "content": "thanks"},
    ]


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}],
        [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}],
    ],
)
def test_images_are_refused(content) -> None:
    with pytest.raises(InvalidRequestError, match="image content is not supported"):
        chat_messages(request(messages=[{"role": "user", "content": content}]))


def test_tools_become_openai_functions_unless_choice_is_none() -> None:
    tools = chat_tools(request(tools=[TOOL]))
    assert tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": TOOL["input_schema"],
            },
        }
    ]
    assert chat_tools(request(tools=[TOOL], tool_choice={"type": "any"})) == tools
    assert chat_tools(request(tools=[TOOL], tool_choice={"type": "none"})) is None


def test_server_tools_are_left_out_and_named_other_typed_tools_refused() -> None:
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    fetch = {"type": "web_fetch_20250910", "name": "web_fetch"}
    body = request(tools=[search, TOOL, fetch])
    assert [t["function"]["name"] for t in chat_tools(body) or []] == ["get_weather"]
    assert server_tools(body) == ("web_search_20250305", "web_fetch_20250910")
    assert chat_tools(request(tools=[search])) is None  # nothing left to offer
    # A tool choice naming a server tool cannot be honoured: still a 400.
    with pytest.raises(InvalidRequestError, match="web_search"):
        tool_constraint(
            request(tools=[search, TOOL], tool_choice={"type": "tool", "name": "web_search"})
        )
    # The client runs bash_*/text_editor_* itself with Anthropic's schema: not ours to guess.
    with pytest.raises(InvalidRequestError, match="bash_20250124") as info:
        chat_tools(request(tools=[{"type": "bash_20250124", "name": "bash"}]))
    assert info.value.param == "tools[0].type"


def test_thinking_sampling_and_output_format() -> None:
    assert template_kwargs(request()) is None
    assert template_kwargs(request(thinking={"type": "disabled"})) == {"enable_thinking": False}
    on = request(thinking={"type": "enabled", "budget_tokens": 1024})
    assert template_kwargs(on) == {"enable_thinking": True}
    sampling = sampling_request(request(temperature=0.5, top_k=3, stop_sequences=["X", "Y"]))
    assert sampling.max_tokens == 16 and sampling.temperature == 0.5 and sampling.top_k == 3
    assert sampling.stop == ("X", "Y")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "schema": schema}
    spec = output_grammar(request(output_config={"format": fmt}))
    assert spec is not None and spec.kind == "json_schema" and json.loads(spec.source) == schema
    assert output_grammar(request(output_format=fmt)) == spec.__class__(
        "json_schema", spec.source, True, "output_format.schema"
    )
    assert output_grammar(request()) is None
    with pytest.raises(InvalidRequestError, match="json_schema"):
        output_grammar(request(output_format={"type": "text"}))


# ---- responses -------------------------------------------------------------------


def test_stop_reason_mapping() -> None:
    assert stop_reason("stop", False, None) == "end_turn"
    assert stop_reason("length", False, None) == "max_tokens"
    # A budget clamped to the room left ran out: the window is full, not max_tokens.
    assert stop_reason("length", False, None, window_bound=True) == "model_context_window_exceeded"
    assert stop_reason("stop", False, None, window_bound=True) == "end_turn"
    assert stop_reason("stop", False, "###") == "stop_sequence"
    assert stop_reason("stop", True, None) == "tool_use"
    assert stop_reason("length", True, None) == "tool_use"


def test_body_has_thinking_then_text_and_anthropic_usage() -> None:
    _, fmt = run(tokens("<think>plan", "</think>\n\n", "Hello", " world", cached=4))
    body = fmt.body()
    assert body["id"] == "msg_1" and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [
        {"type": "thinking", "thinking": "plan", "signature": ""},
        {"type": "text", "text": "Hello world"},
    ]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    assert body["usage"] == {
        "input_tokens": 6,
        "output_tokens": 5,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
    }


def test_stream_event_sequence_and_indices() -> None:
    frames, _ = run(tokens("<think>a", "</think>", "Hi"), stops=())
    names = [name for name, _ in frames]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = frames[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 10 and start["usage"]["output_tokens"] == 0
    assert frames[3][1] == {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "thinking_delta", "thinking": "a"},
    }
    assert frames[6][1]["index"] == 1 and frames[6][1]["delta"] == {
        "type": "text_delta",
        "text": "Hi",
    }
    end = frames[-2][1]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 4
    assert all(payload["type"] == name for name, payload in frames)


def test_tool_call_streams_as_one_tool_use_block_and_sets_stop_reason() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    frames, fmt = run(tokens("Let me check.\n", call[:20], call[20:]))
    names = [name for name, _ in frames]
    assert names[2:] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = frames[5][1]["content_block"]
    assert start["type"] == "tool_use" and start["id"].startswith("toolu_")
    assert start["name"] == "get_weather" and start["input"] == {}
    delta = frames[6][1]["delta"]
    assert delta["type"] == "input_json_delta"
    assert json.loads(delta["partial_json"]) == {"city": "Paris"}
    body = fmt.body()
    assert body["stop_reason"] == "tool_use"
    assert body["content"][0] == {"type": "text", "text": "Let me check.\n"}
    assert body["content"][1] == {
        "type": "tool_use",
        "id": start["id"],
        "name": "get_weather",
        "input": {"city": "Paris"},
    }
    assert "tool_call" not in json.dumps(frames[:5])


def test_whitespace_alone_opens_no_text_block() -> None:
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    _, fmt = run(tokens("\n", call, "\n"))
    assert [b["type"] for b in fmt.body()["content"]] == ["tool_use"]


def test_max_tokens_and_stop_sequence_finishes() -> None:
    _, fmt = run(tokens("abc", finish="length"), stops=("###",))
    assert fmt.body()["stop_reason"] == "max_tokens" and fmt.body()["stop_sequence"] is None
    _, fmt = run(tokens("abc", stop="@@"), stops=("###", "@@"))
    assert fmt.body()["stop_reason"] == "stop_sequence" and fmt.body()["stop_sequence"] == "@@"
    # Stop sequences given, but the model ended on its own.
    _, fmt = run(tokens("abc"), stops=("###",))
    assert fmt.body()["stop_reason"] == "end_turn" and fmt.body()["stop_sequence"] is None
    _, fmt = run(tokens(finish="stop"))
    assert fmt.body()["content"] == [] and fmt.body()["stop_reason"] == "end_turn"


@pytest.mark.parametrize(
    ("error_type", "status", "expected"),
    [
        ("invalid_request_error", 400, "invalid_request_error"),
        ("authentication_error", 401, "authentication_error"),
        ("not_found_error", 404, "not_found_error"),
        ("rate_limited", 429, "rate_limit_error"),
        ("server_error", 500, "api_error"),
        ("insufficient_memory", 507, "api_error"),
        ("overloaded_error", 503, "overloaded_error"),
        ("whatever", 529, "overloaded_error"),
    ],
)
def test_anthropic_error_types(error_type: str, status: int, expected: str) -> None:
    body = anthropic_error_body("boom", error_type, status)
    assert body == {"type": "error", "error": {"type": expected, "message": "boom"}}
