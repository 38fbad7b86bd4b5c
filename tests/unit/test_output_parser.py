"""Splitting streamed output into content, reasoning and tool calls, however it is chunked."""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load
from mlx_lm.tool_parsers import glm47, mistral
from tokenizers import Tokenizer

from omlx.api.output_parser import (
    OutputParser,
    ParsedDelta,
    ToolMarkup,
    json_tool_call,
    mlx_tool_parser,
    parser_for,
)
from tests.fixtures.tiny_models import train_tokenizer

HERMES = ToolMarkup("<tool_call>", "</tool_call>", json_tool_call)
MARKUP_PIECES = ("<think", "</think", "think>", "<tool_call", "</tool_call", "tool_call>")
LOGGER = "omlx.api.output_parser"

WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}'
TIME = '{"name": "get_time", "parameters": {"tz": "UTC"}}'


@dataclass
class Totals:
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    deltas: list[ParsedDelta] = field(default_factory=list)


def run(parser: OutputParser, chunks: Iterable[str]) -> Totals:
    totals = Totals()
    totals.deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    for delta in totals.deltas:
        totals.content += delta.content
        totals.reasoning += delta.reasoning
        totals.calls += [(c.name, json.loads(c.arguments)) for c in delta.tool_calls]
    return totals


def random_chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        chunks.append(text[i : i + n])
        i += n
    return chunks


def chunkings(text: str) -> list[list[str]]:
    """Whole, one character at a time, and random splits with fixed seeds."""
    return [[text], list(text)] + [random_chunks(text, seed) for seed in range(20)]


# (output, parser kwargs, expected content, expected reasoning, expected calls)
RECORDED: dict[str, tuple[str, dict[str, Any], str, str, list[tuple[str, dict[str, Any]]]]] = {
    "qwen3 thinking answer": (
        "<think>\nThe user greets me. I'll greet back.\n</think>\n\nHello! How can I help?",
        {},
        "Hello! How can I help?",
        "\nThe user greets me. I'll greet back.\n",
        [],
    ),
    "prompt opened think": (
        "Okay, 2+2 is 4.\n</think>\n\nThe answer is **4**.\n\nDone.",
        {"starts_in_reasoning": True},
        "The answer is **4**.\n\nDone.",
        "Okay, 2+2 is 4.\n",
        [],
    ),
    "text around think, lookalike tags": (
        "Sure <b>x</b> <thin <think>a < b</thin></think>  after </tool x",
        {"tools": HERMES},
        "Sure <b>x</b> <thin after </tool x",
        "a < b</thin>",
        [],
    ),
    "unicode": (
        "<think>日本語で考える🙂</think>\n答えは 🚀 です",
        {},
        "答えは 🚀 です",
        "日本語で考える🙂",
        [],
    ),
    "reasoning then tool call": (
        f"<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>",
        {"tools": HERMES},
        "",
        "\nNeed the weather.\n",
        [("get_weather", {"city": "Zürich", "unit": "celsius"})],
    ),
    "two tool calls with text": (
        f"Checking both.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        {"tools": HERMES},
        "Checking both.\n\n",
        "",
        [("get_weather", {"city": "Zürich", "unit": "celsius"}), ("get_time", {"tz": "UTC"})],
    ),
    "list of calls in one block": (
        f"<tool_call>[{WEATHER}, {TIME}]</tool_call>",
        {"tools": HERMES},
        "",
        "",
        [("get_weather", {"city": "Zürich", "unit": "celsius"}), ("get_time", {"tz": "UTC"})],
    ),
    "tool call before closing think": (
        f"<think>I will call it.<tool_call>{WEATHER}</tool_call>Called.</think>Result soon.",
        {"tools": HERMES},
        "Result soon.",
        "I will call it.Called.",
        [("get_weather", {"city": "Zürich", "unit": "celsius"})],
    ),
}


@pytest.mark.parametrize("name", RECORDED)
def test_every_chunking_gives_the_same_totals(name):
    output, kwargs, content, reasoning, calls = RECORDED[name]
    for chunks in chunkings(output):
        totals = run(OutputParser(**kwargs), chunks)
        assert (totals.content, totals.reasoning, totals.calls) == (content, reasoning, calls), (
            chunks
        )


@pytest.mark.parametrize("name", RECORDED)
def test_no_delta_shows_markup(name):
    output, kwargs, *_ = RECORDED[name]
    for chunks in chunkings(output):
        for delta in run(OutputParser(**kwargs), chunks).deltas:
            text = delta.content + delta.reasoning
            assert not any(piece in text for piece in MARKUP_PIECES if piece in output), (
                chunks,
                delta,
            )


def test_text_streams_at_once_and_only_a_possible_marker_is_held():
    parser = OutputParser(tools=HERMES)

    assert parser.feed("Hello wor").content == "Hello wor"
    assert parser.feed("ld <").content == "ld "
    assert parser.feed("b> ok </tool").content == "<b> ok </tool"  # not a content marker
    assert parser.feed(" <tool").content == " "
    assert parser.feed("s>").content == "<tools>"
    assert not parser.finish()


def test_a_dangling_marker_prefix_is_flushed_as_text_at_finish():
    parser = OutputParser(tools=HERMES)

    assert parser.feed("see <tool_ca").content == "see "
    assert parser.finish().content == "<tool_ca"


def test_think_markers_split_across_chunks():
    parser = OutputParser()

    assert not parser.feed("<thi")
    assert parser.feed("nk>plan").reasoning == "plan"
    assert parser.feed(" more</thi") == ParsedDelta(reasoning=" more")
    assert not parser.feed("nk>\n")
    assert parser.feed("\nAnswer").content == "Answer"
    assert parser.feed(" \n").content == " \n"  # only whitespace right after </think> goes


def test_starts_in_reasoning_until_the_end_marker():
    parser = OutputParser(starts_in_reasoning=True)

    assert parser.feed("thinking <think> still") == ParsedDelta(reasoning="thinking <think> still")
    assert parser.feed("</think>done") == ParsedDelta(content="done")


def test_without_think_markers_everything_is_content():
    totals = run(OutputParser(think=None, starts_in_reasoning=True), ["<think>a</think>b"])

    assert (totals.content, totals.reasoning) == ("<think>a</think>b", "")


def test_tool_call_split_across_chunks_is_held_until_its_end_marker():
    body = f"\n{WEATHER}\n"
    chunks = ["Let me check.", "\n<tool", "_call>", body[:10], body[10:], "</tool_", "call>", "\n"]
    parser = OutputParser(tools=HERMES)

    deltas = [parser.feed(chunk) for chunk in chunks]

    assert [d.content for d in deltas] == ["Let me check.", "\n", "", "", "", "", "", "\n"]
    assert [len(d.tool_calls) for d in deltas] == [0, 0, 0, 0, 0, 0, 1, 0]
    assert parser.saw_tool_calls
    assert not parser.finish()


def test_tool_call_ids_and_arguments():
    totals = run(OutputParser(tools=HERMES), [f"<tool_call>{WEATHER}</tool_call>" * 3])
    calls = [c for d in totals.deltas for c in d.tool_calls]

    assert len(calls) == 3
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert len({c.id for c in calls}) == 3
    # compact JSON, non-ASCII kept
    assert calls[0].arguments == '{"city":"Zürich","unit":"celsius"}'


def test_tool_markup_is_content_when_tools_are_not_given():
    output = f"<tool_call>{WEATHER}</tool_call>"
    parser = OutputParser()

    totals = run(parser, list(output))

    assert (totals.content, totals.calls, parser.saw_tool_calls) == (output, [], False)


@pytest.mark.parametrize("seed", range(5))
def test_malformed_json_comes_back_as_content_with_a_warning(caplog, seed):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    output = f"Let me check.{bad} Anything else?"
    parser = OutputParser(tools=HERMES)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        totals = run(parser, random_chunks(output, seed))

    assert (totals.content, totals.calls) == (output, [])
    assert not parser.saw_tool_calls
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [logging.WARNING]


def test_a_malformed_block_between_good_ones_does_not_stop_them(caplog):
    bad = '<tool_call>{"arguments": {}}</tool_call>'
    output = f"<tool_call>{WEATHER}</tool_call>{bad}<tool_call>{TIME}</tool_call>"

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        totals = run(OutputParser(tools=HERMES), list(output))

    assert totals.content == bad
    assert [name for name, _ in totals.calls] == ["get_weather", "get_time"]
    assert len(caplog.records) == 1


def test_malformed_block_opened_in_reasoning_returns_to_reasoning(caplog):
    output = "<think>try <tool_call>nope</tool_call> again</think>ok"

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        totals = run(OutputParser(tools=HERMES), [output])

    assert (totals.reasoning, totals.content) == ("try <tool_call>nope</tool_call> again", "ok")
    assert caplog.records


def test_a_block_with_no_calls_in_it_is_content(caplog):
    markup = ToolMarkup("<tool_call>", "</tool_call>", lambda body: [])

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        totals = run(OutputParser(tools=markup), ["<tool_call>{}</tool_call>"])

    assert (totals.content, totals.calls) == ("<tool_call>{}</tool_call>", [])
    assert "no tool call" in caplog.text


@pytest.mark.parametrize("tail", ["", "\n", "\n</tool", "</tool_call"])
def test_unterminated_block_is_parsed_at_finish(tail):
    parser = OutputParser(tools=HERMES)

    assert not parser.feed(f"<tool_call>\n{WEATHER}{tail}")
    delta = parser.finish()

    assert delta.content == ""
    assert [c.name for c in delta.tool_calls] == ["get_weather"]
    assert parser.saw_tool_calls


def test_unterminated_malformed_block_comes_back_as_content(caplog):
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    parser = OutputParser(tools=HERMES)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        totals = run(parser, ["Hi. ", cut])

    assert (totals.content, totals.calls) == ("Hi. " + cut, [])
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_empty_end_marker_runs_to_the_end_of_output():
    markup = ToolMarkup(
        mistral.tool_call_start, mistral.tool_call_end, mlx_tool_parser(mistral.parse_tool_call)
    )
    output = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}get_time[ARGS]{}'

    for chunks in chunkings(output):
        totals = run(OutputParser(tools=markup), chunks)
        assert totals.content == "Sure."
        assert totals.calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]


# calls without their markup


NAMES = frozenset({"get_weather", "get_time"})


@pytest.mark.parametrize(
    "output",
    [
        WEATHER,
        f"\n{WEATHER}\n",
        f"```json\n{WEATHER}\n```",
        f"{WEATHER}\n</tool_call>",
        f"[{WEATHER}, {TIME}]",
    ],
)
def test_an_answer_that_is_only_a_declared_call_without_markup_is_that_call(output):
    for chunks in chunkings(output):
        totals = run(OutputParser(tools=HERMES, tool_names=NAMES), chunks)
        assert totals.content == ""
        assert totals.calls[0] == ("get_weather", {"city": "Zürich", "unit": "celsius"})


@pytest.mark.parametrize(
    "output",
    [
        '{"name": "rm_rf", "arguments": {}}',  # not a declared tool
        '{"answer": 42}',  # JSON, but no call
        f"The call would be {WEATHER}",  # prose first: the call is an example
        f"{WEATHER} is what I would send",
    ],
)
def test_anything_else_stays_text(output):
    for chunks in chunkings(output):
        totals = run(OutputParser(tools=HERMES, tool_names=NAMES), chunks)
        assert (totals.content, totals.calls) == (output, [])


def test_prose_streams_at_once_and_json_waits_for_the_end():
    prose = OutputParser(tools=HERMES, tool_names=NAMES)
    assert prose.feed("  Sure").content == "  Sure"
    maybe = OutputParser(tools=HERMES, tool_names=NAMES)
    assert not maybe.feed('{"ans')
    assert maybe.finish().content == '{"ans'
    # Without declared names (no tools asked), nothing is held.
    assert OutputParser(tools=HERMES).feed('{"ans').content == '{"ans'


# json_tool_call


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})]),
        ('\n {"name": "f", "parameters": {"a": 1}} \n', [("f", {"a": 1})]),
        ('{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}', [("f", {"a": [1, 2]})]),
        ('{"name": "f"}', [("f", {})]),
        ('{"name": "f", "arguments": ""}', [("f", {})]),
        (
            '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": null}}]',
            [("f", {}), ("g", {"b": None})],
        ),
        # Recovered: a stray closing brace, two calls in one block.
        ('{"name": "f", "arguments": {"a": 1}}}', [("f", {"a": 1})]),
        ('{"name": "f", "arguments": {}}\n{"name": "g"}', [("f", {}), ("g", {})]),
    ],
)
def test_json_tool_call_accepts(body, expected):
    assert json_tool_call(body) == expected


@pytest.mark.parametrize(
    "body",
    [
        "",
        "not json",
        '{"name": "f", "arguments": {"a": }}',
        "[]",
        '{"arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": "[1, 2]"}',
        '{"name": "f", "arguments": "{broken"}',
        '"just a string"',
        # Text after the call could be anything: not guessed at.
        '{"name": "f", "arguments": {}} and then more',
        '{"name": "f", "arguments": {}}} {"name": "g"}',
    ],
)
def test_json_tool_call_rejects_with_value_error(body):
    with pytest.raises(ValueError):
        json_tool_call(body)


# mlx-lm tool parsers


def test_mlx_parser_errors_of_any_kind_become_value_error():
    def parse_tool_call(text: str, tools: Any = None) -> Any:
        raise SyntaxError("bad python")

    with pytest.raises(ValueError, match="SyntaxError"):
        mlx_tool_parser(parse_tool_call)("x")


def test_glm_fallback_for_unparsable_text_is_malformed():
    assert glm47.parse_tool_call("") == {"name": "unknown", "arguments": {"raw": ""}}
    with pytest.raises(ValueError):
        mlx_tool_parser(glm47.parse_tool_call)("")


# parser_for


def make_wrapper(folder: Path, special: list[str], **defaults: Any) -> Any:
    """A real mlx-lm TokenizerWrapper over a tiny offline-trained tokenizer."""
    train_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(special)
    tok.save(str(folder / "tokenizer.json"))
    return load(folder, defaults=defaults)


@pytest.fixture(scope="module")
def qwen3_coder_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    special = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    folder = tmp_path_factory.mktemp("qwen3-coder-tok")
    return make_wrapper(folder, special, tool_parser_type="qwen3_coder")


@pytest.fixture(scope="module")
def longcat_think_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("longcat-tok")
    return make_wrapper(folder, ["<longcat_think>", "</longcat_think>"])


QWEN3_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
WEATHER_SCHEMA = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


def test_real_wrapper_declares_what_parser_for_reads(qwen3_coder_tokenizer):
    # The premise of the tests below: these are mlx-lm's real property names.
    tok = qwen3_coder_tokenizer
    assert (tok.has_thinking, tok.think_start, tok.think_end) == (True, "<think>", "</think>")
    assert (tok.has_tool_calling, tok.tool_call_start, tok.tool_call_end) == (
        True,
        "<tool_call>",
        "</tool_call>",
    )
    assert tok.tool_parser.__module__ == "mlx_lm.tool_parsers.qwen3_coder"


def test_parser_for_wraps_the_tokenizers_tool_parser(qwen3_coder_tokenizer):
    output = f"<think>weather</think>\n\n{QWEN3_CODER_CALL}"

    for chunks in chunkings(output):
        parser = parser_for(
            qwen3_coder_tokenizer, tools_requested=True, tool_schemas=WEATHER_SCHEMA
        )
        totals = run(parser, chunks)
        assert (totals.content, totals.reasoning) == ("", "weather")
        assert totals.calls == [("get_weather", {"city": "Paris", "days": 3})]


def test_parser_for_without_schemas_leaves_qwen3_coder_values_as_strings(qwen3_coder_tokenizer):
    totals = run(parser_for(qwen3_coder_tokenizer, tools_requested=True), [QWEN3_CODER_CALL])

    assert totals.calls == [("get_weather", {"city": "Paris", "days": "3"})]


def test_parser_for_tool_parser_failure_is_content(qwen3_coder_tokenizer, caplog):
    output = f"<tool_call>\n{WEATHER}\n</tool_call>"  # JSON, but qwen3_coder wants XML

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        totals = run(parser_for(qwen3_coder_tokenizer, tools_requested=True), list(output))

    assert (totals.content, totals.calls) == (output, [])
    assert "No function provided" in caplog.text


def test_parser_for_ignores_tool_markup_when_no_tools_were_requested(qwen3_coder_tokenizer):
    totals = run(parser_for(qwen3_coder_tokenizer, tools_requested=False), [QWEN3_CODER_CALL])

    assert (totals.content, totals.calls) == (QWEN3_CODER_CALL, [])


def test_parser_for_uses_the_declared_think_markers(longcat_think_tokenizer):
    assert longcat_think_tokenizer.think_start == "<longcat_think>"
    output = "<longcat_think>hmm</longcat_think>\n<think>x</think>"

    totals = run(parser_for(longcat_think_tokenizer, tools_requested=False), list(output))

    assert (totals.reasoning, totals.content) == ("hmm", "<think>x</think>")


def test_parser_for_wrapper_without_a_tool_parser_uses_hermes_json(longcat_think_tokenizer):
    assert not longcat_think_tokenizer.has_tool_calling

    totals = run(
        parser_for(longcat_think_tokenizer, tools_requested=True),
        [f"<tool_call>{TIME}</tool_call>"],
    )

    assert (totals.content, totals.calls) == ("", [("get_time", {"tz": "UTC"})])


@pytest.mark.parametrize(
    "tokenizer", [object(), SimpleNamespace(think_start=None, tool_parser=len)]
)
def test_parser_for_plain_objects_get_the_defaults(tokenizer):
    output = f"<think>r</think> c<tool_call>{WEATHER}</tool_call>"

    totals = run(parser_for(tokenizer, tools_requested=True), list(output))

    assert (totals.reasoning, totals.content) == ("r", "c")
    assert [name for name, _ in totals.calls] == ["get_weather"]


def test_parser_for_reasoning_off_leaves_think_text_in_content():
    totals = run(
        parser_for(object(), tools_requested=False, reasoning=False), ["<think>r</think>c"]
    )

    assert (totals.reasoning, totals.content) == ("", "<think>r</think>c")


@pytest.mark.parametrize(
    ("prompt", "starts_in_reasoning"),
    [
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<think>old</think> user turn <|im_start|>assistant\n<think>\n", True),
    ],
)
def test_parser_for_reads_starts_in_reasoning_from_the_prompt(prompt, starts_in_reasoning):
    parser = parser_for(object(), tools_requested=False, prompt_text=prompt)

    totals = run(parser, ["plan</think>answer"])

    expected = ("plan", "answer") if starts_in_reasoning else ("", "plan</think>answer")
    assert (totals.reasoning, totals.content) == expected
