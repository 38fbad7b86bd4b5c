"""Which chat-template variables a request or a model setting may pass.

``chat_template_kwargs`` reach ``tokenizer.apply_chat_template(**kwargs)``, where
a key can be a *parameter* (``chat_template`` replaces the model's template with
the caller's Jinja; ``tokenize``/``return_dict`` change what comes back) or a
*variable* the template reads (``enable_thinking``). Only variables are allowed,
and only small plain-JSON values, so a request cannot bring its own template or
make rendering arbitrarily large.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

MAX_VARS = 32
MAX_NAME_CHARS = 64
MAX_STRING_CHARS = 1024
MAX_ITEMS = 64  # per list or dict inside a value
MAX_DEPTH = 2  # a list of dicts of scalars, at most

# Named parameters of transformers' apply_chat_template / render_jinja_template
# and mlx-lm's custom renderers (tests/unit/test_template_vars.py checks the
# installed transformers against this list), and the names the renderer itself
# passes to the template. add_generation_prompt and continue_final_message are
# set by omlx: the API decides where the assistant's turn starts.
RESERVED = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "conversations",
        "documents",
        "max_length",
        "messages",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "sanitize_control_tokens",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    }
)
# Functions in the template's namespace (Jinja's defaults and transformers'):
# a variable of that name would shadow what the template calls.
TEMPLATE_FUNCTIONS = frozenset(
    {"range", "dict", "lipsum", "cycler", "joiner", "namespace", "raise_exception", "strftime_now"}
)

_NAME = re.compile(rf"[A-Za-z][A-Za-z0-9_]{{0,{MAX_NAME_CHARS - 1}}}")


class TemplateVarError(ValueError):
    """A chat-template variable that is not allowed; ``key`` is the offending name."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def check_template_vars(variables: Mapping[str, Any]) -> None:
    """Raise ``TemplateVarError`` unless ``variables`` are plain template variables."""
    if len(variables) > MAX_VARS:
        first_extra = list(variables)[MAX_VARS]
        raise TemplateVarError(
            str(first_extra), f"at most {MAX_VARS} chat template variables are allowed"
        )
    for key, value in variables.items():
        _check_name(key)
        problem = _value_problem(value, depth=0)
        if problem:
            raise TemplateVarError(key, f"chat template variable '{key}': {problem}")


def _check_name(key: object) -> None:
    name = str(key)
    if not isinstance(key, str) or not _NAME.fullmatch(key):
        raise TemplateVarError(
            name[:MAX_NAME_CHARS],
            f"chat template variable names are letters, digits and '_', start with a "
            f"letter and have at most {MAX_NAME_CHARS} characters (got {name[:80]!r})",
        )
    if key in RESERVED:
        raise TemplateVarError(
            key,
            f"'{key}' is a parameter of the chat template renderer (omlx sets what it "
            "needs), not a template variable; remove it from chat_template_kwargs",
        )
    if key in TEMPLATE_FUNCTIONS:
        raise TemplateVarError(
            key, f"'{key}' names a function the chat template calls; use another name"
        )


def _value_problem(value: object, depth: int) -> str | None:
    """Why ``value`` is not a small plain-JSON value (None when it is)."""
    if value is None or isinstance(value, (bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else "numbers must be finite"
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            return f"strings are limited to {MAX_STRING_CHARS} characters (got {len(value)})"
        return None
    if isinstance(value, (list, dict)):
        if depth >= MAX_DEPTH:
            return f"values may nest lists and objects at most {MAX_DEPTH} deep"
        if len(value) > MAX_ITEMS:
            return f"lists and objects are limited to {MAX_ITEMS} items (got {len(value)})"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for inner_key, item in items:
            if isinstance(value, dict) and not _is_short_string(inner_key):
                return f"object keys must be strings of at most {MAX_STRING_CHARS} characters"
            problem = _value_problem(item, depth + 1)
            if problem:
                return problem
        return None
    kind = type(value).__name__
    return f"values must be JSON strings, numbers, booleans, null, lists or objects, not {kind}"


def _is_short_string(key: object) -> bool:
    return isinstance(key, str) and len(key) <= MAX_STRING_CHARS
