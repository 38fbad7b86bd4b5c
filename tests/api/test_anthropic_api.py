"""The Anthropic Messages API through the official `anthropic` client, on a live server."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from omlx.api.hosted_tools import DROPPED_HEADER
from omlx.api.server import Server
from tests.fixtures.servers import aborted_count, wait_aborted

MODEL = "tiny-llama"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    # No retries: a 503 or a dropped connection must show up in the test.
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def create(client: anthropic.Anthropic, extra_body=None, **kw) -> anthropic.types.Message:
    # The SDK no longer names temperature (newer Claude models fix it); the API takes it.
    args = {"model": MODEL, "messages": ASK, "max_tokens": 24, **kw}
    return client.messages.create(**args, extra_body={"temperature": 0, **(extra_body or {})})


def text_of(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def raw_events(server: Server, **kw) -> list[tuple[str, dict]]:
    """Every (event name, data) of a streamed message, pings included."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0, **kw}
    events = []
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
    return events


def test_non_streaming_message_shape(client: anthropic.Anthropic) -> None:
    out = create(client, max_tokens=12)
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant"
    assert out.model == MODEL
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert [b.type for b in out.content] == ["text"] and text_of(out)
    assert out.usage.output_tokens == 12
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens > 5
    assert out.usage.cache_creation_input_tokens == 0


def test_stream_event_order_and_text_equal_non_streamed(
    client: anthropic.Anthropic, server: Server
) -> None:
    full = create(client, max_tokens=30)
    events = raw_events(server, max_tokens=30)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    deltas = names[3:-3]
    assert deltas and set(deltas) <= {"content_block_delta", "ping"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == text_of(full)
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 30


def test_sdk_stream_helper_accumulates_the_same_message(client: anthropic.Anthropic) -> None:
    full = create(client, max_tokens=20)
    args = {"model": MODEL, "messages": ASK, "max_tokens": 20}
    with client.messages.stream(**args, extra_body={"temperature": 0}) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == text_of(full) == text_of(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20


def test_stop_sequence_truncates_and_is_reported(
    client: anthropic.Anthropic, server: Server
) -> None:
    full = text_of(create(client, max_tokens=40))
    stop = full[12:15]
    expected = full[: full.index(stop)]
    out = create(client, max_tokens=40, stop_sequences=[stop])
    assert text_of(out) == expected
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    events = raw_events(server, max_tokens=40, stop_sequences=[stop])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_count_tokens_matches_a_real_request_and_sees_the_system_prompt(
    client: anthropic.Anthropic,
) -> None:
    counted = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    usage = create(client, max_tokens=2).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens
    system = "You are a terse assistant who answers in one word."
    with_system = client.messages.count_tokens(model=MODEL, messages=ASK, system=system)
    assert with_system.input_tokens > counted
    usage = create(client, max_tokens=2, system=system).usage
    assert with_system.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_json_output_format_validates(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = create(
        client,
        max_tokens=40,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(out)), schema)


def test_tools_render_and_a_forced_tool_call_comes_back_as_tool_use(
    client: anthropic.Anthropic, server: Server
) -> None:
    plain = create(client, model="tiny-qwen3", tools=[TOOL], max_tokens=8)
    assert plain.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # A random model never writes a tool call itself; the choice grammar makes it.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    forced = {"model": "tiny-qwen3", "tools": [TOOL], "max_tokens": 60}
    extra = {"structured_outputs": {"choice": [call]}}
    out = create(client, **forced, extra_body=extra)
    assert out.stop_reason == "tool_use"
    [block] = out.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather" and block.input == {"city": "Paris"}
    events = raw_events(server, messages=ASK, **forced, **extra)
    assert [n for n, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[3][1]["delta"]["type"] == "input_json_delta"
    assert json.loads(events[3][1]["delta"]["partial_json"]) == {"city": "Paris"}
    # The round trip: the tool_use goes back with its tool_result.
    history = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}],
        },
    ]
    again = create(client, model="tiny-qwen3", tools=[TOOL], messages=history, max_tokens=4)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens > (
        out.usage.input_tokens + out.usage.cache_read_input_tokens
    )


def test_server_tools_are_left_out_of_the_prompt_and_named_in_a_header(
    client: anthropic.Anthropic,
) -> None:
    """Anthropic's own servers run web search; the turn goes on with the custom tools."""
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    args = {"model": "tiny-qwen3", "messages": ASK, "max_tokens": 4}
    with_search = client.messages.with_raw_response.create(
        **args, tools=[TOOL, search], extra_body={"temperature": 0}
    )
    assert with_search.headers[DROPPED_HEADER] == "web_search_20250305"
    alone = create(client, model="tiny-qwen3", tools=[TOOL], max_tokens=4)
    assert prompt_of(with_search.parse()) == prompt_of(alone)


def prompt_of(message: anthropic.types.Message) -> int:
    """The whole prompt (Anthropic splits it into new, cache-read and cache-written)."""
    usage = message.usage
    cached = (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    return usage.input_tokens + cached


# ---- errors: status and Anthropic shape -------------------------------------------


def anthropic_error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    return body["error"]


def test_unknown_model_is_404_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        create(client, model="nope")
    err = anthropic_error(info.value.response)
    assert err["type"] == "not_found_error" and "tiny-llama" in err["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=ASK)


def test_missing_max_tokens_and_bad_values_are_400(server: Server) -> None:
    url = server.base_url + "/v1/messages"
    missing = httpx.post(url, json={"model": MODEL, "messages": ASK})
    assert missing.status_code == 400
    err = anthropic_error(missing)
    assert err["type"] == "invalid_request_error" and "max_tokens" in err["message"]
    hot = httpx.post(
        url, json={"model": MODEL, "messages": ASK, "max_tokens": 4, "temperature": 1.5}
    )
    assert hot.status_code == 400 and "temperature" in anthropic_error(hot)["message"]


def test_image_block_is_400(client: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=[{"role": "user", "content": [image]}])
    err = anthropic_error(info.value.response)
    assert err["type"] == "invalid_request_error" and "image" in err["message"]


def test_openai_routes_keep_the_openai_envelope(server: Server) -> None:
    resp = httpx.post(server.base_url + "/v1/chat/completions", json={"model": "nope"})
    assert resp.status_code == 400 and set(resp.json()) == {"error"}


# ---- client disconnect --------------------------------------------------------------

SLOW = "slow-llama"
# Greedy: this model's greedy reply to ASK runs past 400 tokens without an end, while a
# sampled one ends in its first 15 tokens about once in 150 requests, finishing
# before the disconnect is seen (nothing left to abort).
GREEDY = {"temperature": 0}


def test_client_disconnect_mid_stream_aborts(client: anthropic.Anthropic, server: Server) -> None:
    create(client, model=SLOW, max_tokens=1)  # the model is loaded
    before = aborted_count(server, SLOW)
    body = {"model": SLOW, "messages": ASK, "max_tokens": 4000, "stream": True, **GREEDY}
    with (
        httpx.Client(base_url=server.base_url, timeout=30) as http,
        http.stream("POST", "/v1/messages", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(9)]
        assert "event: content_block_start" in got
    wait_aborted(server, SLOW, before + 1)


def test_non_streaming_client_disconnect_aborts(
    client: anthropic.Anthropic, server: Server
) -> None:
    create(client, model=SLOW, max_tokens=1)
    before = aborted_count(server, SLOW)
    body = {"model": SLOW, "messages": ASK, "max_tokens": 4000, **GREEDY}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/messages", json=body, timeout=0.05)
    wait_aborted(server, SLOW, before + 1)
