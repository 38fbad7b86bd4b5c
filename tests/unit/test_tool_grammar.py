"""Tool-call grammars: what they let a model write, and how requests ask for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from omlx.api.anthropic_format import tool_constraint as anthropic_constraint
from omlx.api.anthropic_schemas import MessagesRequest
from omlx.api.output_parser import parser_for
from omlx.api.prompts import with_hermes_tools
from omlx.api.tool_grammar import combined, openai_tool_constraint, tool_grammar_spec
from omlx.errors import InvalidRequestError
from omlx.grammar.compiler import GrammarCompiler
from omlx.grammar.spec import GrammarSpec
from omlx.grammar.tools import HERMES, ToolConstraint, tool_grammar
from tests.fixtures.tiny_models import train_tokenizer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


def function(name: str, parameters: dict | None, strict: bool | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "parameters": parameters}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


TOOLS = [function("get_weather", WEATHER, strict=True), function("add", ADD)]


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


PARIS = call("get_weather", {"city": "Paris", "unit": "celsius"})
SUM = call("add", {"a": 2, "b": 3})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def compiler(hf_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [hf_tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def eos(hf_tokenizer: Any) -> int:
    return hf_tokenizer.eos_token_id


def complete(compiler: GrammarCompiler, eos: int, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar takes ``text`` and may end right after it."""
    matcher = compiler.matcher(compiler.compile(spec))
    return matcher.accept_string(text) and matcher.accept_token(eos)


def constraint(tools: list[dict], choice: Any = None, parallel: Any = None) -> ToolConstraint:
    rule = openai_tool_constraint(tools, choice, parallel)
    assert rule is not None
    return rule


# ---- the grammars ------------------------------------------------------------------


def test_auto_with_a_strict_tool_allows_text_and_holds_calls_to_the_schema(compiler, eos):
    spec = tool_grammar(constraint(TOOLS), HERMES)
    accepts = [
        "Just text, no call.",
        PARIS,
        "Let me check. " + PARIS + " Done.",
        PARIS + SUM,
        # The tool without strict takes any object.
        call("add", {"a": "two", "extra": [1]}),
    ]
    for text in accepts:
        assert complete(compiler, eos, spec, text), text
    refuses = [
        call("get_weather", {"city": "Paris", "unit": "kelvin"}),
        call("get_weather", {"city": "Paris"}),
        call("get_weather", {"city": "Paris", "unit": "celsius", "country": "FR"}),
        call("delete_everything", {}),
    ]
    for text in refuses:
        assert not complete(compiler, eos, spec, text), text


def test_required_allows_only_calls_and_at_least_one(compiler, eos):
    spec = tool_grammar(constraint(TOOLS, "required"), HERMES)
    assert complete(compiler, eos, spec, PARIS)
    assert complete(compiler, eos, spec, PARIS + SUM)
    assert not complete(compiler, eos, spec, "")
    assert not complete(compiler, eos, spec, "Sure. " + PARIS)
    # Under required every tool's schema holds, strict or not.
    assert not complete(compiler, eos, spec, call("add", {"a": "two", "b": 3}))
    # Keys the schema does not name are allowed for a tool that is not strict.
    assert complete(compiler, eos, spec, call("add", {"a": 1, "b": 2, "c": 3}))
    single = tool_grammar(constraint(TOOLS, "required", parallel=False), HERMES)
    assert complete(compiler, eos, single, SUM)
    assert not complete(compiler, eos, single, PARIS + SUM)


def test_named_choice_forces_one_call_of_that_tool(compiler, eos):
    spec = tool_grammar(
        constraint(TOOLS, {"type": "function", "function": {"name": "add"}}), HERMES
    )
    assert complete(compiler, eos, spec, SUM)
    assert not complete(compiler, eos, spec, PARIS)
    assert not complete(compiler, eos, spec, SUM + SUM)
    assert not complete(compiler, eos, spec, "ok")


def test_a_reasoning_model_may_think_before_a_forced_call(compiler, eos):
    spec = tool_grammar(constraint(TOOLS, "required"), HERMES, ("<think>", "</think>"))
    assert complete(compiler, eos, spec, "<think>The user wants weather.</think>\n\n" + PARIS)
    # The prompt may have opened the block already.
    assert complete(compiler, eos, spec, "Weather, then.</think>\n" + PARIS)
    assert complete(compiler, eos, spec, PARIS)
    assert not complete(compiler, eos, spec, "<think>only thinking</think>")


def test_what_the_grammar_allows_the_output_parser_reads(compiler, eos, tokenizer_dir):
    spec = tool_grammar(constraint(TOOLS, "required"), HERMES)
    assert complete(compiler, eos, spec, PARIS + SUM)
    parser = parser_for(load_tokenizer(tokenizer_dir), tools_requested=True)
    parsed = parser.feed(PARIS + SUM)
    parsed.tool_calls += parser.finish().tool_calls
    assert parsed.content == "" and parsed.reasoning == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("add", {"a": 2, "b": 3}),
    ]
    # Compact JSON only: no free whitespace for a small model to loop on.
    matcher = compiler.matcher(compiler.compile(spec))
    assert matcher.accept_string('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert not matcher.accept_string(" ")


def test_a_schema_xgrammar_rejects_is_a_400_naming_the_tool():
    tools = [function("ok", ADD), function("bad", {"type": "strng"}, strict=True)]
    with pytest.raises(InvalidRequestError) as err:
        tool_grammar(constraint(tools), HERMES)
    assert err.value.param == "tools[1].function.parameters"
    assert "'bad'" in err.value.message and 'Unsupported type "strng"' in err.value.message
    assert "cpp" not in err.value.message  # xgrammar's log prefix is cleaned off


# ---- OpenAI request fields ----------------------------------------------------------


def test_which_openai_requests_need_a_grammar():
    loose = [function("add", ADD)]
    assert openai_tool_constraint(loose, None) is None
    assert openai_tool_constraint(loose, "auto") is None
    assert openai_tool_constraint(TOOLS, "none") is None
    assert openai_tool_constraint(None, None) is None
    auto = constraint(TOOLS)
    assert auto.mode == "auto" and [t.name for t in auto.tools] == ["get_weather", "add"]
    assert [t.strict for t in auto.tools] == [True, False]
    assert constraint(loose, "required").mode == "required"
    named = constraint(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.mode == "forced" and [t.name for t in named.tools] == ["add"]
    flat = constraint(TOOLS, {"type": "function", "name": "add"})  # Responses API shape
    assert [t.name for t in flat.tools] == ["add"]
    assert constraint(TOOLS, "required", parallel=False).parallel is False
    custom = {"type": "custom", "custom": {"name": "shell"}}
    assert [t.name for t in constraint([custom, *TOOLS]).tools] == ["get_weather", "add"]


def test_allowed_tools_narrows_the_choice():
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "add"}}],
        },
    }
    rule = constraint(TOOLS, choice)
    assert rule.mode == "required" and [t.name for t in rule.tools] == ["add"]


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [
        (
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice.function.name",
            "'nope'",
        ),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name", "name"),
        (None, "required", "tool_choice", "at least one tool"),
        ([], {"type": "function", "function": {"name": "x"}}, "tool_choice.function.name", "'x'"),
        (TOOLS, "sometimes", "tool_choice", "must be"),
        (
            TOOLS,
            {"type": "allowed_tools", "allowed_tools": {"mode": "any"}},
            "tool_choice.allowed_tools.mode",
            "mode",
        ),
        ([{"type": "function"}], "required", "tools[0].function.name", "tools[0]"),
        (
            [function("f", ["not", "a", "schema"])],
            "required",
            "tools[0].function.parameters",
            "schema",
        ),
    ],
)
def test_bad_tool_choices_are_400_with_the_field(tools, choice, param, words):
    with pytest.raises(InvalidRequestError) as err:
        openai_tool_constraint(tools, choice)
    assert err.value.param == param and err.value.http_status == 400
    assert words in err.value.message


def test_an_output_format_and_a_tool_grammar_are_not_combined():
    fmt = GrammarSpec("json_object", param="response_format")
    rule = constraint(TOOLS, "required")
    assert combined(fmt, None) is fmt and combined(None, rule) is rule
    with pytest.raises(InvalidRequestError) as err:
        combined(fmt, rule)
    assert err.value.param == "tool_choice" and "response_format" in err.value.message


# ---- Anthropic request fields ------------------------------------------------------


def anthropic(**fields) -> ToolConstraint | None:
    body = MessagesRequest(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}], **fields
    )
    return anthropic_constraint(body)


A_TOOLS = [
    {"name": "get_weather", "input_schema": WEATHER, "strict": True},
    {"name": "add", "input_schema": ADD},
]


def test_anthropic_tool_choice_any_and_tool_force_calls():
    assert anthropic(tools=[A_TOOLS[1]]) is None
    assert anthropic(tools=[A_TOOLS[1]], tool_choice={"type": "auto"}) is None
    assert anthropic(tools=A_TOOLS, tool_choice={"type": "none"}) is None
    strict = anthropic(tools=A_TOOLS)
    assert strict.mode == "auto" and [t.strict for t in strict.tools] == [True, False]
    assert strict.tools[0].param == "tools[0].input_schema"
    any_ = anthropic(tools=A_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert any_.mode == "required" and any_.parallel is False
    named = anthropic(tools=A_TOOLS, tool_choice={"type": "tool", "name": "add"})
    assert named.mode == "forced" and [t.name for t in named.tools] == ["add"]
    with pytest.raises(InvalidRequestError) as err:
        anthropic(tools=A_TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert err.value.param == "tool_choice.name"
    with pytest.raises(InvalidRequestError) as err:
        anthropic(tool_choice={"type": "any"})
    assert err.value.param == "tool_choice"


# ---- the model's tool-call format --------------------------------------------------


def test_a_model_family_without_a_grammar_syntax_is_refused(tokenizer_dir: Path):
    hermes = load_tokenizer(tokenizer_dir)
    assert tool_grammar_spec(hermes, constraint(TOOLS, "required")).kind == "grammar"
    coder = load_tokenizer(tokenizer_dir, {"tool_parser_type": "qwen3_coder"})
    with pytest.raises(InvalidRequestError) as err:
        tool_grammar_spec(coder, constraint(TOOLS, "required"))
    assert err.value.param == "tool_choice"
    assert "'qwen3_coder'" in err.value.message and "not supported" in err.value.message
    json_tools = load_tokenizer(tokenizer_dir, {"tool_parser_type": "json_tools"})
    assert tool_grammar_spec(json_tools, constraint(TOOLS)).kind == "grammar"


# ---- telling a template-less model about tools -------------------------------------


def test_hermes_tool_prompt_for_templates_without_tools():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    out = with_hermes_tools(history, TOOLS)
    assert out[0]["content"].startswith("Be brief.\n\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) in out[0]["content"]
    assert "<tool_call></tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call("get_weather", {"city": "Paris"})}
    assert history[2]["tool_calls"]  # the caller's messages are left alone
    fresh = with_hermes_tools([{"role": "user", "content": "hi"}], TOOLS)
    assert fresh[0]["role"] == "system" and fresh[1] == {"role": "user", "content": "hi"}
