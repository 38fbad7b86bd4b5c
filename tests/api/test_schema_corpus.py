"""A corpus of real-world schemas through the live server and the openai client:
every schema accepted under strict gets a greedy output that validates (formats
checked too); every keyword the grammar cannot enforce is refused under strict,
naming it, and listed in a response header otherwise.

The tiny random models write near-random JSON, which pushes each constraint to
its edge. Reproduce: PYTHONPATH=$PWD python -m pytest -q -s tests/api/test_schema_corpus.py
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anthropic
import jsonschema
import jsonschema_rs
import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.schema_corpus import ENFORCED, UNENFORCED, Case

HEADER = "x-omlx-unenforced-schema-keywords"
MSG = [{"role": "user", "content": "Fill in the record."}]
# Enough for the corpus's bounded records; a random model may still wander in an
# unbounded number or a recursive tree until it runs out.
MAX_TOKENS = 320


@dataclass
class Outcome:
    case: Case
    finish_reason: str
    text: str
    header: str | None


def response_format(case: Case, strict: bool) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": case.name, "schema": case.schema, "strict": strict},
    }


def generate(client: openai.OpenAI, case: Case, model: str, strict: bool) -> Outcome:
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=MSG,
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format=response_format(case, strict),  # type: ignore[arg-type]
    )
    choice = raw.parse().choices[0]
    return Outcome(
        case, choice.finish_reason, choice.message.content or "", raw.headers.get(HEADER)
    )


def violations(case: Case, text: str) -> list[str]:
    """What is wrong with ``text`` under the case's schema: jsonschema with its
    format checker, and jsonschema_rs for the formats the former cannot check
    (date-time, time, hostname, uri, duration, json-pointer)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc}"]
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    validator = jsonschema.Draft202012Validator(case.schema, format_checker=checker)
    found = [f"jsonschema: {e.message}" for e in validator.iter_errors(value)]
    strict_formats = jsonschema_rs.validator_for(case.schema, validate_formats=True)
    found += [f"jsonschema_rs: {e.message}" for e in strict_formats.iter_errors(value)]
    return found


def keywords_named(header: str | None) -> set[str]:
    return {item.split(" at ")[0] for item in (header or "").split("; ") if item}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_every_accepted_schema_gets_a_valid_output(client: openai.OpenAI, model: str) -> None:
    assert len(ENFORCED) + len(UNENFORCED) >= 40
    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(lambda c: generate(client, c, model, True), ENFORCED))
    completed = [o for o in outcomes if o.finish_reason == "stop"]
    truncated = sorted(o.case.name for o in outcomes if o.finish_reason == "length")
    broken = {o.case.name: (o.text, violations(o.case, o.text)) for o in completed}
    broken = {name: found for name, found in broken.items() if found[1]}
    print(
        f"\n{model}: {len(ENFORCED) + len(UNENFORCED)} schemas, {len(ENFORCED)} accepted under "
        f"strict, {len(UNENFORCED)} refused; {len(completed)} completed within {MAX_TOKENS} "
        f"tokens, truncated (not judged): {truncated or 'none'}; violations: {len(broken)}"
    )
    assert not broken, broken
    assert all(o.header is None for o in outcomes), [o.case.name for o in outcomes if o.header]
    assert {o.finish_reason for o in outcomes} <= {"stop", "length"}
    # A truncated output cannot be judged: most must complete for the test to mean much.
    assert len(completed) >= 0.85 * len(outcomes), truncated


@pytest.mark.parametrize("case", UNENFORCED, ids=lambda c: c.name)
def test_strict_refuses_what_the_grammar_cannot_enforce(client: openai.OpenAI, case: Case) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        generate(client, case, "tiny-llama", True)
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == "response_format.json_schema.schema"
    assert error["code"] == "unsupported_schema_keyword"
    for keyword in case.unenforced:
        assert f"{keyword} at $" in error["message"], error["message"]
    assert "strict: false" in error["message"]


def test_without_strict_the_header_names_what_is_not_enforced(client: openai.OpenAI) -> None:
    def lenient(case: Case) -> Outcome:
        return generate(client, case, "tiny-llama", False)

    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(lenient, UNENFORCED))
    for outcome in outcomes:
        assert keywords_named(outcome.header) == outcome.case.unenforced, outcome.header
        assert " at $" in (outcome.header or "")


# ---- the other places a schema comes from ---------------------------------------------

TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    "required": ["tags"],
}


def tool(strict: bool) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": "tag", "parameters": TAGS, "strict": strict},
    }


def test_a_strict_tool_with_an_unenforceable_keyword_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-llama",
            messages=MSG,
            max_tokens=8,
            tools=[tool(True)],  # type: ignore[list-item]
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == "tools[0].function.parameters"
    assert "uniqueItems at $.properties.tags" in error["message"]


def test_a_forced_lenient_tool_reports_it_in_the_header(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=MSG,
        max_tokens=8,
        tools=[tool(False)],  # type: ignore[list-item]
        tool_choice="required",
    )
    assert raw.headers[HEADER] == (
        "uniqueItems at $.properties.tags (tools[0].function.parameters)"
    )


def test_a_streamed_lenient_response_carries_the_header(client: openai.OpenAI) -> None:
    case = UNENFORCED[0]
    with client.chat.completions.with_streaming_response.create(
        model="tiny-llama",
        messages=MSG,
        max_tokens=8,
        stream=True,
        response_format=response_format(case, False),  # type: ignore[arg-type]
    ) as raw:
        assert keywords_named(raw.headers.get(HEADER)) == case.unenforced
        assert "data: " in "".join(raw.iter_lines())


def test_anthropic_output_format_and_strict_tools_are_strict(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    args: dict[str, Any] = {"model": "tiny-llama", "max_tokens": 8, "messages": MSG}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            **args,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": TAGS}}},
        )
    assert "uniqueItems at $.properties.tags" in info.value.message
    strict_tool = {"name": "tag", "input_schema": TAGS, "strict": True}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**args, tools=[strict_tool])  # type: ignore[list-item]
    assert "uniqueItems at $.properties.tags" in info.value.message
    lenient = client.messages.with_raw_response.create(
        **args, tools=[{"name": "tag", "input_schema": TAGS}], tool_choice={"type": "any"}
    )
    assert keywords_named(lenient.headers.get(HEADER)) == {"uniqueItems"}
