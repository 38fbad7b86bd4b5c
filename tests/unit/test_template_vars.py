"""chat_template_kwargs carry template variables only: small plain-JSON values under
identifier names, never a parameter of the renderer (a template, tokenize...)."""

from __future__ import annotations

import inspect

import pytest
from mlx_lm.chat_templates import deepseek_v32
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from omlx.api.schemas import ChatCompletionRequest
from omlx.errors import InvalidRequestError, SettingsError
from omlx.models.model_settings import parse_model_settings
from omlx.template_vars import RESERVED, TemplateVarError, check_template_vars


def refused_key(variables: dict) -> str:
    with pytest.raises(TemplateVarError) as caught:
        check_template_vars(variables)
    return caught.value.key


def test_plain_variables_pass() -> None:
    check_template_vars(
        {
            "enable_thinking": False,
            "reasoning_effort": "high",
            "max_depth": 3,
            "temperature_hint": 0.5,
            "persona": None,
            "tags": ["a", "b"],
            "options": {"style": "terse", "level": 2},
            "examples": [{"q": "1+1", "a": "2"}],
            "note": "x" * 1024,
            "many": list(range(64)),
        }
    )


@pytest.mark.parametrize(
    "key",
    [
        "chat_template",
        "tokenize",
        "return_dict",
        "tokenizer_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "messages",
        "tools",
        "documents",
        "return_tensors",
        "__class__",
        "__init__",
        "_private",
        "namespace",
        "raise_exception",
        "1st",
        "with-dash",
        "with space",
        "a" * 65,
        "",
    ],
)
def test_renderer_parameters_and_odd_names_are_refused(key: str) -> None:
    assert refused_key({key: True}) == key[:64]


def test_every_renderer_parameter_of_the_installed_libraries_is_reserved() -> None:
    # A new transformers or mlx-lm parameter must not become settable by a request.
    renderers = [
        PreTrainedTokenizerBase.apply_chat_template,
        render_jinja_template,
        deepseek_v32.apply_chat_template,
    ]
    for renderer in renderers:
        for name, param in inspect.signature(renderer).parameters.items():
            if name != "self" and param.kind is not inspect.Parameter.VAR_KEYWORD:
                assert name in RESERVED, f"{renderer.__qualname__}({name}=...) is not reserved"


@pytest.mark.parametrize(
    ("value", "in_message"),
    [
        ("x" * 1025, "1024 characters"),
        (list(range(65)), "64 items"),
        ({f"k{i}": i for i in range(65)}, "64 items"),
        ([["deep", ["deeper"]]], "2 deep"),
        ({"a": {"b": {"c": 1}}}, "2 deep"),
        ([{"k": "x" * 1025}], "1024 characters"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (b"bytes", "not bytes"),
        (print, "not builtin_function_or_method"),
    ],
)
def test_values_must_be_small_plain_json(value, in_message: str) -> None:
    with pytest.raises(TemplateVarError, match=in_message) as caught:
        check_template_vars({"var": value})
    assert caught.value.key == "var"


def test_at_most_32_variables() -> None:
    check_template_vars({f"v{i}": i for i in range(32)})

    assert refused_key({f"v{i}": i for i in range(33)}) == "v32"


def test_a_request_naming_a_renderer_parameter_is_a_400_naming_the_key() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": True, "chat_template": "{{ 1 }}"},
    }
    with pytest.raises(InvalidRequestError) as caught:
        ChatCompletionRequest.model_validate(body)

    assert caught.value.http_status == 400
    assert caught.value.param == "chat_template_kwargs.chat_template"


def test_model_settings_take_template_variables_only() -> None:
    ok = parse_model_settings({"chat_template_kwargs": {"enable_thinking": False}})
    assert ok.chat_template_kwargs == {"enable_thinking": False}

    with pytest.raises(SettingsError) as caught:
        parse_model_settings({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    assert caught.value.param == "chat_template_kwargs"
    assert "'chat_template' is a parameter of the chat template renderer" in caught.value.message
