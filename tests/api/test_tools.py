"""Tool calls through the OpenAI API with the official client: a tiny model whose
chat template renders tools, its output driven into tool-call markup by a grammar."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

# ChatML plus tools (Hermes/Qwen style): tool list in a system block, assistant
# tool calls as <tool_call> JSON, tool results as role "tool".
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    '{"name": "{{ c["function"]["name"] }}", "arguments": {{ c["function"]["arguments"] }}}'
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator:
    root = tmp_path_factory.mktemp("tool-models")
    model = root / "tool-qwen3"
    shutil.copytree(tiny_models_dir / "tiny-qwen3", model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    with live_server(tmp_path_factory.mktemp("tool-base"), root, profiles=profiles_dir) as srv:
        srv: Server
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)


def forced(text: str) -> dict:
    """Make the random model write exactly ``text`` (structured output, one choice)."""
    return {"structured_outputs": {"choice": [text]}}


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="tool-qwen3", messages=ASK, tools=TOOLS, max_tokens=80, extra_body=forced(CALL)
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Send the result back: the template renders the call and the tool message.
    follow = client.chat.completions.create(
        model="tool-qwen3",
        messages=[
            *ASK,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
        ],
        tools=TOOLS,
        max_tokens=40,
        extra_body=forced("It is 21 degrees."),
    )
    assert follow.choices[0].message.content == "It is 21 degrees."
    assert follow.choices[0].finish_reason == "stop"
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_tools_change_the_prompt_and_none_hides_them(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="tool-qwen3", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(
        model="tool-qwen3", messages=ASK, tools=TOOLS, max_tokens=1
    )
    hidden = client.chat.completions.create(
        model="tool-qwen3", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streamed_tool_call_never_shows_markup(client: openai.OpenAI) -> None:
    text = "Let me check. " + CALL
    stream = client.chat.completions.create(
        model="tool-qwen3",
        messages=ASK,
        tools=TOOLS,
        # Room for the forced text however the sampled tokens split it (the
        # random model may spell it in short pieces).
        max_tokens=200,
        stream=True,
        extra_body=forced(text),
    )
    content, calls, reasons = "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Let me check. "
    assert "<tool_call>" not in content
    assert [c.function.name for c in calls] == ["get_weather"]
    assert calls[0].index == 0 and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert reasons[-1] == "tool_calls"


def test_malformed_tool_json_comes_back_as_text(client: openai.OpenAI) -> None:
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    reply = client.chat.completions.create(
        model="tool-qwen3", messages=ASK, tools=TOOLS, max_tokens=80, extra_body=forced(broken)
    )
    assert reply.choices[0].message.content == broken
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "written",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # no wrapper
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}}</tool_call>',
    ],
)
def test_a_call_written_slightly_wrong_is_recovered_streamed_or_not(
    client: openai.OpenAI, written: str
) -> None:
    """Small models drop the wrapper, fence the JSON or add a brace: one reading only."""
    args = {"model": "tool-qwen3", "messages": ASK, "tools": TOOLS, "max_tokens": 120}
    reply = client.chat.completions.create(**args, extra_body=forced(written))
    (call,) = reply.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert reply.choices[0].message.content is None
    assert reply.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**args, stream=True, extra_body=forced(written)))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert content == "" and [t.function.name for t in streamed] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
