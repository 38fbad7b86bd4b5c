"""Function tools through the Responses API: the official `openai` client (a call
forced by tool_choice, its output fed back) and the OpenAI Agents SDK running an
agent with one tool against the live server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import agents
import jsonschema
import openai
import pydantic
import pytest

from omlx.api.hosted_tools import DROPPED_HEADER
from omlx.api.server import Server
from tests.fixtures.servers import live_server

MODEL = "tiny-llama"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": WEATHER,
        "strict": True,
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "Time in a city",
        "parameters": WEATHER,
    },
]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module", autouse=True)
def no_tracing() -> None:
    agents.set_tracing_disabled(True)  # the SDK would upload traces to OpenAI


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("responses-tools"), tiny_models_dir, profiles=profiles_dir
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def create(client: openai.OpenAI, **kw) -> openai.types.responses.Response:
    args = {"model": MODEL, "input": ASK, "tools": TOOLS, "temperature": 0}
    return client.responses.create(**{**args, "max_output_tokens": 80, **kw})


def calls_of(resp: openai.types.responses.Response) -> list:
    return [item for item in resp.output if item.type == "function_call"]


def test_required_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = create(client, tool_choice="required", parallel_tool_calls=False)
    assert first.status == "completed"
    (call,) = calls_of(first)
    assert call.name in ("get_weather", "get_time") and call.call_id.startswith("call_")
    assert call.status == "completed" and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow = create(client, previous_response_id=first.id, input=[result], max_output_tokens=6)
    assert follow.status in ("completed", "incomplete") and follow.output
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items[-2:]] == ["function_call", "function_call_output"]
    assert items[-1].output == "Sunny, 21 C" and items[-2].call_id == call.call_id
    # The same conversation sent whole (stateless) renders the same prompt.
    whole = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    stateless = create(client, input=whole, store=False, max_output_tokens=6)
    assert stateless.usage.input_tokens == follow.usage.input_tokens
    assert stateless.output_text == follow.output_text


def test_named_tool_choice_calls_that_tool_and_streams_its_events(client: openai.OpenAI) -> None:
    choice = {"type": "function", "name": "get_time"}
    events = list(create(client, tool_choice=choice, stream=True))
    types = [e.type for e in events]
    call_events = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    start = types.index("response.output_item.added")
    assert types[start : start + 4] == call_events
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    (call,) = calls_of(final)
    assert call.name == "get_time"
    assert events[start + 2].arguments == call.arguments
    assert events[start + 3].item.call_id == call.call_id


def test_tool_choice_none_hides_the_tools(client: openai.OpenAI) -> None:
    resp = create(client, tool_choice="none", max_output_tokens=10)
    assert calls_of(resp) == [] and resp.output[0].type == "message"


def test_tool_choice_naming_an_unknown_tool_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, tool_choice={"type": "function", "name": "nope"})
    err = info.value.response.json()["error"]
    assert err["param"] == "tool_choice.name" and "'nope'" in err["message"]


# Codex's first request declares its sub-agent tools in a namespace and a hosted
# web search (captured from the real CLI: benchmarks/agent_traffic/).
CODEX_TOOLS = [
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for spawning and managing sub-agents.",
        "tools": [{**TOOLS[0], "name": "spawn_agent"}, {**TOOLS[1], "name": "close_agent"}],
    },
    {"type": "web_search", "external_web_access": True},
]


def test_namespace_tools_are_called_by_their_own_name_and_namespace(
    client: openai.OpenAI,
) -> None:
    """The model sees multi_agent_v1__spawn_agent; the client gets its call back as
    name spawn_agent in namespace multi_agent_v1, and sends it back in that shape."""
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input=ASK,
        tools=CODEX_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=80,
    )
    assert raw.headers[DROPPED_HEADER] == "web_search"
    first = raw.parse()
    (call,) = calls_of(first)
    assert call.name in ("spawn_agent", "close_agent")
    assert call.model_dump()["namespace"] == "multi_agent_v1"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "spawned"}
    follow = create(
        client,
        previous_response_id=first.id,
        input=[result],
        tools=CODEX_TOOLS,
        max_output_tokens=6,
    )
    # Codex is stateless: it sends the call back as it got it, namespace and all.
    whole = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    stateless = create(client, input=whole, tools=CODEX_TOOLS, store=False, max_output_tokens=6)
    assert stateless.usage.input_tokens == follow.usage.input_tokens
    assert stateless.output_text == follow.output_text
    # Sent back without its namespace, the call names another tool: another prompt.
    bare = {k: v for k, v in call.model_dump(exclude_none=True).items() if k != "namespace"}
    other = create(
        client, input=[whole[0], bare, result], tools=CODEX_TOOLS, store=False, max_output_tokens=6
    )
    assert other.usage.input_tokens != follow.usage.input_tokens


def test_two_tools_of_one_flat_name_are_400(client: openai.OpenAI) -> None:
    clash = [{**TOOLS[0], "name": "multi_agent_v1__spawn_agent"}, CODEX_TOOLS[0]]
    with pytest.raises(openai.BadRequestError) as info:
        create(client, tools=clash)
    assert "multi_agent_v1__spawn_agent" in info.value.response.json()["error"]["message"]


class Forecast(pydantic.BaseModel):
    sky: Literal["sunny", "rainy"]


def weather_agent(server: Server, seen: list[str]) -> agents.Agent:
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    return agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        output_type=Forecast,
        model=agents.OpenAIResponsesModel(MODEL, client),
        # "required" forces the call; the SDK resets it to auto after the call.
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0, max_tokens=120, parallel_tool_calls=False
        ),
    )


def check_run(result: agents.RunResultBase, seen: list[str]) -> None:
    assert len(seen) == 1 and seen[0] in ("Paris", "Oslo")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert result.new_items[1].output == f"Sunny in {seen[0]}"
    assert isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2


def test_agents_sdk_runs_an_agent_with_a_function_tool(server: Server) -> None:
    """OpenAIResponsesModel against the server: the model calls the tool (forced),
    the SDK sends its output back and the model answers in the output type (the
    schema's grammar makes the random model finish)."""
    seen: list[str] = []
    agent = weather_agent(server, seen)
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=3))
    check_run(result, seen)


def test_agents_sdk_chains_turns_through_previous_response_id(server: Server) -> None:
    """The SDK's server-side chaining: the second turn sends only the tool output and
    previous_response_id; the stored first turn supplies the rest."""
    seen: list[str] = []
    agent = weather_agent(server, seen)
    run = agents.Runner.run(agent, ASK, max_turns=3, auto_previous_response_id=True)
    result = asyncio.run(run)
    check_run(result, seen)
    first, second = result.raw_responses
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    stored = client.responses.retrieve(second.response_id)
    assert stored.previous_response_id == first.response_id
    items = client.responses.input_items.list(second.response_id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


def test_agents_sdk_streamed_run(server: Server) -> None:
    seen: list[str] = []
    agent = weather_agent(server, seen)

    async def run() -> tuple[agents.RunResultStreaming, list[str]]:
        result = agents.Runner.run_streamed(agent, ASK, max_turns=3)
        names = [e.name async for e in result.stream_events() if e.type == "run_item_stream_event"]
        return result, names

    result, names = asyncio.run(run())
    check_run(result, seen)
    assert names == ["tool_called", "tool_output", "message_output_created"]
