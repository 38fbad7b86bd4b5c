"""The OpenAI Responses API (/v1/responses) through the official `openai` client on a
live server: create, stream, store and chain, retrieve / delete / input_items,
structured output, truncation, validation, disconnects."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from omlx.api.hosted_tools import DROPPED_HEADER
from omlx.api.server import Server
from tests.fixtures.servers import aborted_count, live_server, wait_aborted
from tests.fixtures.tiny_models import CHATML, build_tiny_model

MODEL = "tiny-llama"
SLOW = "slow-llama"
WINDOW = 512
BLOCK = 16


# Shows the template variables reasoning.effort sets: the preamble's length tells them.
EFFORT_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "{% if not enable_thinking %}{{ ' no thinking' * 20 }}{% endif %}<|im_end|>\n{% endif %}"
    + CHATML
)

# A reasoning model's template: the assistant turn opens a think block unless told not to.
THINK_TEMPLATE = CHATML.replace(
    "'<|im_start|>assistant\\n'",
    "'<|im_start|>assistant\\n' + ('' if enable_thinking is defined and not enable_thinking "
    "else '<think>\\n')",
)


def with_template(model: Path, template: str) -> None:
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("responses-models")
    for name in (MODEL, SLOW):
        (root / name).symlink_to(tiny_models_dir / name, target_is_directory=True)
    shutil.copytree(tiny_models_dir / MODEL, root / "effort-llama")
    with_template(root / "effort-llama", EFFORT_TEMPLATE)
    build_tiny_model(root / "think-llama", "llama", seed=3, extra_special=("<think>", "</think>"))
    with_template(root / "think-llama", THINK_TEMPLATE)
    with live_server(
        tmp_path_factory.mktemp("responses"),
        root,
        cache={"block_size": BLOCK},
        generation={"max_context_window": WINDOW},
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def create(client: openai.OpenAI, **kw) -> openai.types.responses.Response:
    args = {"model": MODEL, "input": "Tell me about Paris.", "temperature": 0}
    return client.responses.create(**{**args, "max_output_tokens": 12, **kw})


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}
    return body["error"]


def test_create_returns_a_completed_response_with_usage(client: openai.OpenAI) -> None:
    resp = create(client, max_output_tokens=40, metadata={"run": "1"}, instructions="Be brief.")
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == MODEL and resp.metadata == {"run": "1"}
    assert resp.instructions == "Be brief." and resp.store is True
    assert resp.status in ("completed", "incomplete")
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert resp.output_text == message.content[0].text
    usage = resp.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 40
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens


def test_responses_count_in_the_dashboard_stats(client: openai.OpenAI, server: Server) -> None:
    def stats() -> dict:
        return httpx.get(server.base_url + "/admin/api/stats", timeout=30).json()

    before = stats()
    resp = create(client, max_output_tokens=3)
    after = stats()
    assert after["requests"]["total"] == before["requests"]["total"] + 1
    added = after["tokens"]["completion_total"] - before["tokens"]["completion_total"]
    assert added == resp.usage.output_tokens


def test_max_output_tokens_cut_is_incomplete(client: openai.OpenAI) -> None:
    resp = create(client, max_output_tokens=3)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3
    assert resp.output[0].status == "incomplete"


def test_stream_events_in_order_and_text_equals_the_final_text(client: openai.OpenAI) -> None:
    events = list(create(client, max_output_tokens=10, stream=True))
    types = [e.type for e in events]
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.status == "incomplete" and final.usage.output_tokens == 10
    assert streamed == final.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2])
    # Greedy: the same text as without streaming, and the stored copy is the final one.
    assert create(client, max_output_tokens=10).output_text == streamed
    assert client.responses.retrieve(final.id).output_text == streamed


def test_previous_response_id_continues_and_hits_the_prefix_cache(client: openai.OpenAI) -> None:
    long_input = "The quick brown fox jumps over the lazy dog near the river bank. " * 8
    first = create(client, input=long_input, max_output_tokens=8)
    assert first.usage.input_tokens >= 4 * BLOCK
    follow = create(client, input="And then?", previous_response_id=first.id, max_output_tokens=4)
    assert follow.previous_response_id == first.id
    # The earlier input and output are in the prompt...
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # ...and that prefix was computed already.
    cached = follow.usage.input_tokens_details.cached_tokens
    assert cached >= 3 * BLOCK
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert [i.role for i in items] == ["user", "assistant", "user"]
    assert items[0].content[0].text == long_input
    assert items[1].content[0].text == first.output_text
    assert items[2].content[0].text == "And then?"


def test_reasoning_effort_reaches_the_chat_template(client: openai.OpenAI) -> None:
    def num_input_tokens(**kw: object) -> int:
        return create(client, model="effort-llama", max_output_tokens=1, **kw).usage.input_tokens

    plain = num_input_tokens()
    high = num_input_tokens(reasoning={"effort": "high"})
    off = num_input_tokens(reasoning={"effort": "none"})
    assert plain < high < off - 20  # reasoning_effort is set; enable_thinking false for none
    resp = create(client, model="effort-llama", reasoning={"effort": "low", "summary": "auto"})
    assert resp.reasoning.effort == "low"


def test_reasoning_comes_back_as_a_reasoning_item(client: openai.OpenAI) -> None:
    resp = create(client, model="think-llama", max_output_tokens=8, reasoning={"effort": "high"})
    reasoning = resp.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text
    details = resp.usage.output_tokens_details
    assert 1 <= details.reasoning_tokens <= resp.usage.output_tokens == 8
    events = list(create(client, model="think-llama", max_output_tokens=8, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert (
        "".join(deltas)
        == reasoning.content[0].text
        == events[-1].response.output[0].content[0].text
    )
    assert events[3].part.type == "reasoning_text"
    # effort "none": the template gets enable_thinking false and opens no think block.
    off = create(client, model="think-llama", max_output_tokens=8, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_non_streaming_disconnect_aborts_the_request(client: openai.OpenAI, server: Server) -> None:
    create(client, model=SLOW, max_output_tokens=1)
    before = aborted_count(server, SLOW)
    body = {"model": SLOW, "input": "Go on.", "max_output_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the server generates
        httpx.post(server.base_url + "/v1/responses", json=body, timeout=0.2)
    wait_aborted(server, SLOW, before + 1)


def test_input_tokens_count_matches_what_create_uses(client: openai.OpenAI) -> None:
    first = create(client, instructions="Be brief.")
    counted = client.responses.input_tokens.count(
        model=MODEL, input="Tell me about Paris.", instructions="Be brief."
    )
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == first.usage.input_tokens
    chained = {"model": MODEL, "input": "More?", "previous_response_id": first.id}
    follow = create(client, **chained, max_output_tokens=2)
    assert client.responses.input_tokens.count(**chained).input_tokens == follow.usage.input_tokens


def test_unknown_previous_response_id_is_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        create(client, previous_response_id="resp_nope")
    err = error_of(info.value)
    assert err["param"] == "previous_response_id" and "resp_nope" in err["message"]


def test_retrieve_delete_and_input_items(client: openai.OpenAI) -> None:
    resp = create(
        client,
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        ],
    )
    got = client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump()
    page = client.responses.input_items.list(resp.id)  # newest first by default
    assert [i.role for i in page.data] == ["user", "developer"]
    assert page.first_id == page.data[0].id and page.has_more is False
    first = client.responses.input_items.list(resp.id, order="asc", limit=1)
    assert first.data[0].role == "developer" and first.has_more is True
    rest = client.responses.input_items.list(resp.id, order="asc", after=first.data[0].id)
    assert [i.role for i in rest.data] == ["user"] and rest.has_more is False
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)


def test_concurrent_creates_are_all_stored(client: openai.OpenAI) -> None:
    def one(i: int) -> openai.types.responses.Response:
        if i % 2:
            return create(client, input=f"Question {i}?", max_output_tokens=3)
        events = list(create(client, input=f"Question {i}?", max_output_tokens=3, stream=True))
        return events[-1].response

    with ThreadPoolExecutor(6) as pool:
        made = list(pool.map(one, range(6)))
    for i, resp in enumerate(made):
        assert client.responses.retrieve(resp.id).output_text == resp.output_text
        items = client.responses.input_items.list(resp.id).data
        assert items[0].content[0].text == f"Question {i}?"


def test_store_false_is_not_retrievable(client: openai.OpenAI) -> None:
    resp = create(client, store=False)
    assert resp.store is False and resp.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_cancel_is_refused_for_foreground_responses(client: openai.OpenAI) -> None:
    resp = create(client)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(resp.id)
    assert "background" in error_of(info.value)["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")
    with pytest.raises(openai.BadRequestError) as info:
        create(client, background=True)
    assert error_of(info.value)["param"] == "background"


def test_json_schema_format_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "rank": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    resp = create(client, text={"format": fmt}, max_output_tokens=60)
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"
    resp = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=20)
    # A random model may wander through keys until the limit; an object it starts.
    assert resp.output_text.startswith("{")


def test_unenforceable_schema_keyword_refused_when_strict_else_flagged(
    client: openai.OpenAI,
) -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "tags", "schema": schema, "strict": True}
    with pytest.raises(openai.BadRequestError) as info:
        create(client, text={"format": fmt}, max_output_tokens=20)
    assert error_of(info.value)["code"] == "unsupported_schema_keyword"
    assert "uniqueItems at $.properties.tags" in error_of(info.value)["message"]
    fmt["strict"] = False
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Tags?", text={"format": fmt}, max_output_tokens=20
    )
    assert raw.headers["x-omlx-unenforced-schema-keywords"] == "uniqueItems at $.properties.tags"


def test_truncation_disabled_refuses_and_auto_drops_the_oldest(client: openai.OpenAI) -> None:
    turns = [
        {"role": ("user", "assistant")[i % 2], "content": f"Turn {i}: " + "more words " * 16}
        for i in range(12)
    ]
    turns.append({"role": "user", "content": "Last question?"})
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input=turns)
    err = error_of(info.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    assert "truncation" in err["message"]
    resp = create(client, input=turns, truncation="auto")
    assert resp.truncation == "auto"
    assert resp.usage.input_tokens + 12 <= WINDOW
    kept = client.responses.input_items.list(resp.id, order="asc", limit=100).data
    assert 1 <= len(kept) < len(turns)
    # The newest items, starting at a user turn.
    assert [i.content[0].text for i in kept] == [t["content"] for t in turns[-len(kept) :]]
    assert kept[0].role == "user"


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("stream", "yes", "stream"),
        ("store", "false", "store"),
        ("truncation", "sometimes", "truncation"),
        ("tool_choice", "always", "tool_choice"),
        ("tool_choice", {"type": "web_search_preview"}, "tool_choice.type"),
        ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": 5}, "tool_choice.tools"),
        ("tool_choice", {"type": "function"}, "tool_choice.name"),
        ("tools", [{"type": "function", "name": "f", "parameters": 3}], "tools[0].parameters"),
        ("tools", [{"type": "function"}], "tools[0].name"),
        ("input", [{"type": "function_call", "name": "f"}], "input[0].call_id"),
        ("input", [{"role": "tool", "content": "x"}], "input[0].role"),
        ("input", [{"role": "user", "content": 7}], "input[0].content"),
        ("input", 5, "input"),
        ("input", [], "input"),
        ("metadata", {f"k{i}": "v" for i in range(17)}, "metadata"),
        ("metadata", {"n": 1}, "metadata.n"),
        ("reasoning", {"effort": "extreme"}, "reasoning.effort"),
        ("max_output_tokens", 0, "max_output_tokens"),
        ("max_output_tokens", "5", "max_output_tokens"),
        ("temperature", "0.5", "temperature"),
        ("parallel_tool_calls", 1, "parallel_tool_calls"),
        ("previous_response_id", 5, "previous_response_id"),
        ("input", [{"type": "input_image", "image_url": "x"}], "input[0].type"),
        (
            "input",
            [{"role": "user", "content": [{"type": "input_file"}]}],
            "input[0].content[0].type",
        ),
        ("text", {"format": {"type": "yaml"}}, "text.format.type"),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    client: openai.OpenAI, field: str, value: object, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", extra_body={field: value})
    err = error_of(info.value)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_hosted_tools_are_left_out_of_the_prompt_and_named_in_a_header(
    client: openai.OpenAI,
) -> None:
    """Codex declares web_search on every turn: the turn goes on without it."""
    plain = client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=4)
    hosted = [{"type": "web_search"}, {"type": "file_search"}, {"type": "computer_use_preview"}]
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=4, extra_body={"tools": hosted}
    )
    assert raw.status_code == 200
    assert raw.headers[DROPPED_HEADER] == "web_search; file_search; computer_use_preview"
    assert DROPPED_HEADER not in plain.headers
    # Left out: the prompt is the one without tools.
    assert raw.parse().usage.input_tokens == plain.parse().usage.input_tokens


def test_tool_types_nobody_runs_are_400_naming_the_type(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model=MODEL, input="hi", extra_body={"tools": [{"type": "teleport"}]}
        )
    err = error_of(info.value)
    assert err["param"] == "tools[0].type" and "'teleport'" in err["message"]


def test_auth_applies_like_the_openai_routes(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> None:
    with live_server(
        tmp_path_factory.mktemp("responses-auth"),
        tiny_models_dir,
        server={"api_key": "s3cret"},
        profiles=profiles_dir,
    ) as srv:
        url = srv.base_url + "/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).responses.retrieve("x")
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            good.responses.retrieve("resp_x")


def test_disconnect_mid_stream_aborts_the_request(client: openai.OpenAI, server: Server) -> None:
    create(client, model=SLOW, max_output_tokens=1)  # loaded
    before = aborted_count(server, SLOW)
    body = {"model": SLOW, "input": "Go on.", "max_output_tokens": 400, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=30) as http,
        http.stream("POST", "/v1/responses", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(15)]  # five events of three lines
        assert got[12] == "event: response.output_text.delta"
    wait_aborted(server, SLOW, before + 1)
    assert create(client, max_output_tokens=2).status == "incomplete"  # still serving


def test_stored_responses_survive_a_restart(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    base = tmp_path / "base"

    def client_of(srv: Server) -> openai.OpenAI:
        return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)

    with live_server(base, tiny_models_dir, profiles=profiles_dir) as srv:
        kept = create(client_of(srv), max_output_tokens=4)
        gone = create(client_of(srv), store=False, max_output_tokens=4)
    assert (base / "responses.db").is_file()
    with live_server(base, tiny_models_dir, profiles=profiles_dir) as srv:
        client = client_of(srv)
        assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone.id)
        follow = create(client, input="More?", previous_response_id=kept.id, max_output_tokens=4)
        items = client.responses.input_items.list(follow.id, order="asc").data
        texts = [i.content[0].text for i in items]
        assert texts == ["Tell me about Paris.", kept.output_text, "More?"]


def test_the_store_keeps_the_newest_responses(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    with live_server(
        tmp_path, tiny_models_dir, server={"responses_store_max_count": 2}, profiles=profiles_dir
    ) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        ids = [create(client, max_output_tokens=1).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
