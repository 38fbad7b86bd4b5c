"""Forced and strict tool calls with real weights (SmolLM2) through the official clients.

SmolLM2's chat template knows no tools and mlx-lm names no tool parser for it,
so it gets the Hermes format: tools told in the system message, calls written
as <tool_call>{"name": ..., "arguments": ...}</tool_call>, which the grammar
enforces and output_parser reads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CODER = "tiny-coder"  # a tokenizer whose tool format (qwen3_coder XML) has no grammar here
S = {"type": "string", "maxLength": 20}
WEATHER = {
    "type": "object",
    "properties": {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
# (question, tool name, description, schema): one forced call each.
CASES: list[tuple[str, str, str, dict]] = [
    ("What is the weather in Oslo?", "get_weather", "Current weather in a city", WEATHER),
    (
        "Book a meeting called Budget with Ann and Bo on May 3.",
        "create_event",
        "Create a calendar event",
        {
            "type": "object",
            "properties": {
                "title": S,
                "attendees": {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
                "when": {
                    "type": "object",
                    "properties": {
                        "month": {"enum": ["Jan", "Feb", "Mar", "Apr", "May", "Jun"]},
                        "day": {"type": "integer", "minimum": 1, "maximum": 31},
                    },
                    "required": ["month", "day"],
                },
            },
            "required": ["title", "attendees", "when"],
        },
    ),
    (
        "Set the heating to 21.5 degrees.",
        "set_thermostat",
        "Set the target temperature",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": 5, "maximum": 30}},
            "required": ["celsius"],
        },
    ),
    (
        "Look up the customer called Smith.",
        "lookup_customer",
        "Find a customer by numeric id or by name",
        {
            "$defs": {"name": {"type": "string", "minLength": 2, "maxLength": 20}},
            "type": "object",
            "properties": {
                "customer": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 999},
                        {"$ref": "#/$defs/name"},
                    ]
                }
            },
            "required": ["customer"],
        },
    ),
    (
        "Search the docs for 'install', exact match, only guides.",
        "search",
        "Search the documentation",
        {
            "type": "object",
            "properties": {
                "query": S,
                "exact": {"type": "boolean"},
                "kinds": {
                    "type": "array",
                    "items": {"enum": ["guide", "reference", "faq"]},
                    "maxItems": 2,
                },
            },
            "required": ["query", "exact", "kinds"],
        },
    ),
]


def function(name: str, schema: dict, description: str = "", strict: bool = True) -> dict:
    fn = {"name": name, "description": description, "parameters": schema, "strict": strict}
    return {"type": "function", "function": fn}


WEATHER_TOOL = function("get_weather", WEATHER, "Current weather in a city")
ADD_TOOL = function("add", ADD, "Add two integers", strict=False)


@pytest.fixture(scope="module")
def server(
    smollm2_path: Path,
    tiny_models_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    profiles_dir: Path,
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("tool-grammar-models")
    (root / MODEL).symlink_to(smollm2_path, target_is_directory=True)
    coder = root / CODER
    shutil.copytree(tiny_models_dir / "tiny-qwen3", coder)
    config_path = coder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tool_parser_type"] = "qwen3_coder"
    config_path.write_text(json.dumps(config))
    with live_server(
        tmp_path_factory.mktemp("tool-grammar-base"),
        root,
        scheduler={"max_concurrent_requests": 8},
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, question: str | list[dict], **kw: Any) -> Any:
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    args = {"model": MODEL, "temperature": 0, "max_tokens": 90, "messages": messages, **kw}
    return client.chat.completions.create(**args).choices[0]


def calls_of(choice: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_required_gives_calls_that_validate_for_varied_schemas(client: openai.OpenAI) -> None:
    def forced(case: tuple[str, str, str, dict]) -> Any:
        question, name, description, schema = case
        tools = [function(name, schema, description)]
        return chat(
            client, question, tools=tools, tool_choice="required", parallel_tool_calls=False
        )

    with ThreadPoolExecutor(len(CASES)) as pool:
        choices = list(pool.map(forced, CASES))
    for (question, tool, _, schema), choice in zip(CASES, choices, strict=True):
        assert choice.finish_reason == "tool_calls", (question, choice.message)
        assert choice.message.content is None
        [(name, arguments)] = calls_of(choice)
        assert name == tool
        jsonschema.validate(arguments, schema)


def test_required_may_make_several_calls_each_valid(client: openai.OpenAI) -> None:
    choice = chat(
        client,
        "Weather in Rome, and what is 4 plus 5?",
        tools=[WEATHER_TOOL, ADD_TOOL],
        tool_choice="required",
    )
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = calls_of(choice)
    assert calls
    for name, arguments in calls:
        jsonschema.validate(arguments, {"get_weather": WEATHER, "add": ADD}[name])


def streamed_call(client: openai.OpenAI, question: str, **kw: Any) -> tuple[str, list, list]:
    """Content, tool-call deltas and finish reasons of a streamed chat."""
    stream = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=90,
        messages=[{"role": "user", "content": question}],
        stream=True,
        **kw,
    )
    content, deltas, reasons = "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    return content, deltas, reasons


def test_named_tool_choice_calls_that_tool_even_streamed(client: openai.OpenAI) -> None:
    # The first question is about weather; the choice says "add", so "add" it is.
    tools = [WEATHER_TOOL, ADD_TOOL]
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(
            chat,
            client,
            "What is the weather in Paris?",
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "add"}},
        )
        streamed = pool.submit(
            streamed_call,
            client,
            "Weather in Madrid?",
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    choice = whole.result()
    [(name, arguments)] = calls_of(choice)
    assert name == "add" and choice.finish_reason == "tool_calls"
    jsonschema.validate(arguments, ADD)
    content, deltas, reasons = streamed.result()
    assert content == "" and reasons[-1] == "tool_calls"
    assert [d.function.name for d in deltas] == ["get_weather"]
    jsonschema.validate(json.loads(deltas[0].function.arguments), WEATHER)


def earlier_call(arguments: dict, question: str) -> list[dict]:
    """A conversation where the assistant already called get_weather once."""
    call = {"name": "get_weather", "arguments": json.dumps(arguments)}
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
        {"role": "user", "content": question},
    ]


def test_strict_tool_under_auto_holds_calls_to_the_schema(client: openai.OpenAI) -> None:
    # The earlier call used a key the schema does not have, and the model copies it
    # (the loose tool shows that); a strict tool's calls validate all the same.
    history = earlier_call({"location": "Paris"}, "What is the weather in Rome?")
    jobs = [
        lambda: chat(client, history, tools=[function("get_weather", WEATHER, strict=False)]),
        lambda: chat(client, history, tools=[WEATHER_TOOL]),
        # Auto still lets the model answer in text.
        lambda: chat(
            client, earlier_call({"city": "Paris"}, "And in Berlin?"), tools=[WEATHER_TOOL]
        ),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        loose, strict, text = [f.result() for f in [pool.submit(j) for j in jobs]]
    [(_, loose_args)] = calls_of(loose)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(loose_args, WEATHER)
    [(name, arguments)] = calls_of(strict)
    assert name == "get_weather" and strict.finish_reason == "tool_calls"
    jsonschema.validate(arguments, WEATHER)
    assert text.finish_reason == "stop" and text.message.tool_calls is None
    assert "Berlin" in text.message.content


def test_a_batch_mixing_forced_and_plain_requests(client: openai.OpenAI) -> None:
    question = "What is the capital of France?"
    solo = chat(client, question, max_tokens=30).message.content
    forced = {"tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    jobs = [
        lambda: chat(client, "Weather in Lima?", **forced),
        lambda: chat(client, question, max_tokens=30),
        lambda: chat(client, "Weather in Kyiv?", **forced),
        lambda: chat(client, question, max_tokens=30, tools=[WEATHER_TOOL], tool_choice="none"),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        lima, plain, kyiv, hidden = [f.result() for f in [pool.submit(j) for j in jobs]]
    for choice in (lima, kyiv):
        [(name, arguments)] = calls_of(choice)
        assert name == "get_weather"
        jsonschema.validate(arguments, WEATHER)
    assert plain.message.tool_calls is None and plain.message.content == solo
    assert hidden.message.tool_calls is None and hidden.message.content == solo
    assert "Paris" in solo


def test_anthropic_any_and_named_tool_choice(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    tools = [
        {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
        {"name": "add", "description": "Add two integers", "input_schema": ADD, "strict": True},
    ]
    schemas = {"get_weather": WEATHER, "add": ADD}
    choices = [{"type": "any"}, {"type": "tool", "name": "add"}]

    def ask(choice: dict) -> anthropic.types.Message:
        return client.messages.create(
            model=MODEL,
            max_tokens=90,
            messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tools=tools,
            tool_choice=choice,
            extra_body={"temperature": 0},
        )

    with ThreadPoolExecutor(2) as pool:
        any_, named = list(pool.map(ask, choices))
    for message in (any_, named):
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["tool_use"] * len(message.content)
        for block in message.content:
            jsonschema.validate(block.input, schemas[block.name])
    assert [b.name for b in named.content] == ["add"]


# ---- errors -----------------------------------------------------------------------


def bad_request(client: openai.OpenAI, **kw: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "hi", **kw)
    assert err.value.status_code == 400
    return err.value


def test_errors_are_400_naming_the_field(client: openai.OpenAI) -> None:
    err = bad_request(
        client, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "x"}}
    )
    assert err.param == "tool_choice.function.name" and "'x'" in err.message
    err = bad_request(client, tool_choice="required")
    assert err.param == "tool_choice"
    broken = function("broken", {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}})
    err = bad_request(client, tools=[broken])  # strict, under auto
    assert err.param == "tools[0].function.parameters"
    assert "'broken'" in err.message and "none" in err.message
    err = bad_request(
        client,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        response_format={"type": "json_object"},
    )
    assert err.param == "tool_choice" and "response_format" in err.message


def test_forced_choice_on_a_tool_format_without_grammar_is_400(client: openai.OpenAI) -> None:
    err = bad_request(client, model=CODER, tools=[WEATHER_TOOL], tool_choice="required")
    assert "qwen3_coder" in err.message and "not supported" in err.message
    # Without forcing or strict tools the model is served as before.
    out = chat(client, "hi", model=CODER, tools=[ADD_TOOL], max_tokens=3)
    assert out.finish_reason in ("length", "stop", "tool_calls")


def test_anthropic_errors_for_tool_choice(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[{"role": "user", "content": "hi"}],
            tools=[tool],
            tool_choice={"type": "tool", "name": "nope"},
        )
    assert err.value.status_code == 400
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "'nope'" in err.value.body["error"]["message"]
