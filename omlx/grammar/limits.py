"""Caps on what a request may ask a grammar to enforce; pure, checked before compiling.

xgrammar's compile time grows with the repetition bounds of a pattern (quadratic
in the bound), with the number of optional properties of an object (cubic) and
with the source size; the work runs in native code that cannot be interrupted.
These caps keep one grammar to well under a second of compile time, so a request
cannot hold the compile threads (or the server) hostage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omlx.errors import InvalidRequestError

MAX_SOURCE_BYTES = 64 * 1024
# Length / count / quantifier bounds, and nested pattern quantifiers multiplied.
MAX_REPEAT = 1000
# All pattern repetitions of one schema together (each costs compile time).
MAX_PATTERN_REPEAT_TOTAL = 10 * MAX_REPEAT
MAX_SCHEMA_DEPTH = 32
# Nesting of plain JSON values (enum, const, default) inside a schema.
MAX_VALUE_DEPTH = 64
MAX_PROPERTIES = 256
MAX_CHOICES = 1000

_BOUNDED_KEYWORDS = (
    "maxLength",
    "minLength",
    "maxItems",
    "minItems",
    "maxProperties",
    "minProperties",
    "maxContains",
    "minContains",
)
# Keywords whose value is one subschema, a list of them, or a map of them.
_ONE_SCHEMA = (
    "items",
    "additionalProperties",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")


def check_source_size(source: str, what: str, param: str) -> None:
    size = len(source.encode())
    if size > MAX_SOURCE_BYTES:
        raise InvalidRequestError(
            f"the {what} is {size} bytes, above omlx's limit of {MAX_SOURCE_BYTES} bytes "
            "for a grammar; send a smaller one",
            param=param,
        )


def check_regex(source: str, param: str) -> None:
    """Size and quantifier bounds of a regex request."""
    check_source_size(source, "regex", param)
    pattern_repeats(source, "the regex", param)


def check_ebnf(source: str, param: str) -> None:
    """Size and repetition ranges (``{n,m}``) of an EBNF grammar."""
    check_source_size(source, "grammar", param)
    for bound, text in _ebnf_bounds(source):
        _check_bound(bound, "the grammar", param, text)


def check_choices(options: list[str], param: str) -> None:
    if len(options) > MAX_CHOICES:
        raise InvalidRequestError(
            f"{len(options)} choices is above omlx's limit of {MAX_CHOICES}; "
            "use a shorter list or a regex",
            param=param,
        )
    check_source_size(json.dumps(options), "choice list", param)


def check_json_schema(schema: Any, param: str) -> None:
    """InvalidRequestError naming the keyword and its JSON path when the schema's
    depth, bounds, patterns or size go over the caps."""
    SchemaCheck(param).walk(schema)  # first: it bounds the depth json.dumps recurses to
    check_source_size(json.dumps(schema, ensure_ascii=False), "JSON schema", param)


@dataclass
class SchemaCheck:
    """One iterative walk over a schema (no recursion: depth is attacker-chosen)."""

    param: str
    pattern_total: int = 0

    def walk(self, schema: Any) -> None:
        stack: list[tuple[Any, str, int]] = [(schema, "$", 1)]
        while stack:
            node, path, depth = stack.pop()
            if not isinstance(node, dict):
                continue  # true / false / invalid: left to the compiler
            if depth > MAX_SCHEMA_DEPTH:
                raise self._error(
                    f"the schema nests deeper than omlx's limit of {MAX_SCHEMA_DEPTH} "
                    f"levels at {path}"
                )
            self._check_node(node, path)
            stack.extend((sub, sub_path, depth + 1) for sub, sub_path in subschemas(node, path))

    def _check_node(self, node: dict[str, Any], path: str) -> None:
        for keyword in _BOUNDED_KEYWORDS:
            value = node.get(keyword)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and value > MAX_REPEAT
            ):
                raise self._error(
                    f"'{keyword}' {value} at {path} is above omlx's limit of {MAX_REPEAT} "
                    "for enforced lengths"
                )
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > MAX_PROPERTIES:
            raise self._error(
                f"'properties' at {path} declares {len(properties)} properties, above "
                f"omlx's limit of {MAX_PROPERTIES} per object"
            )
        patterns = [(node.get("pattern"), f"'pattern' at {path}")]
        if isinstance(node.get("patternProperties"), dict):
            patterns += [
                (k, f"'patternProperties' key at {path}") for k in node["patternProperties"]
            ]
        for pattern, where in patterns:
            if isinstance(pattern, str):
                self._add_pattern(pattern, where)
        for keyword in ("enum", "const", "default", "examples"):
            if keyword in node:
                _check_value_depth(node[keyword], f"{path}.{keyword}", self.param)

    def _add_pattern(self, pattern: str, where: str) -> None:
        self.pattern_total += pattern_repeats(pattern, where, self.param)
        if self.pattern_total > MAX_PATTERN_REPEAT_TOTAL:
            raise self._error(
                f"the schema's patterns repeat up to {self.pattern_total} times together "
                f"(counted up to {where}), above omlx's limit of {MAX_PATTERN_REPEAT_TOTAL}; "
                "use fewer or shorter bounded repetitions"
            )

    def _error(self, message: str) -> InvalidRequestError:
        return InvalidRequestError(message, param=self.param)


def subschemas(node: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    """Each subschema of ``node`` with its JSON path (also used by schema_review)."""
    for keyword in _ONE_SCHEMA:
        if isinstance(node.get(keyword), dict):
            yield node[keyword], f"{path}.{keyword}"
    for keyword in _SCHEMA_LISTS:
        if isinstance(node.get(keyword), list):
            for i, sub in enumerate(node[keyword]):
                yield sub, f"{path}.{keyword}[{i}]"
    for keyword in _SCHEMA_MAPS:
        if isinstance(node.get(keyword), dict):
            for name, sub in node[keyword].items():
                yield sub, f"{path}.{keyword}{key_path(name)}"


def key_path(name: Any) -> str:
    text = str(name)
    return f".{text}" if text.isidentifier() else f"[{json.dumps(text)}]"


def _check_value_depth(value: Any, path: str, param: str) -> None:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_VALUE_DEPTH:
            raise InvalidRequestError(
                f"the value at {path} nests deeper than omlx's limit of {MAX_VALUE_DEPTH} levels",
                param=param,
            )
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, depth + 1) for child in children)


def _check_bound(bound: int, where: str, param: str, quantifier: str) -> None:
    if bound > MAX_REPEAT:
        raise InvalidRequestError(
            f"{where} has the repetition {quantifier}, above omlx's limit of {MAX_REPEAT} "
            "for enforced lengths",
            param=param,
        )


def pattern_repeats(pattern: str, where: str, param: str) -> int:
    """How many repetitions ``pattern`` enforces in total (nested bounds multiply);
    InvalidRequestError when one bound, or one nesting, goes over ``MAX_REPEAT``."""
    # Per open group: the largest repetition inside it, and the total so far.
    frames: list[list[int]] = [[1, 0]]
    for kind, end in regex_tokens(pattern):
        if kind == "(":
            frames.append([1, 0])
            continue
        inner = frames.pop() if kind == ")" and len(frames) > 1 else [1, 0]
        bound = _quantifier_after(pattern, end)
        if bound is None:
            frames[-1][0] = max(frames[-1][0], inner[0])
            frames[-1][1] += inner[1]
            continue
        _check_bound(bound[0], where, param, bound[1])
        nested = inner[0] * bound[0]
        if nested > MAX_REPEAT:
            raise InvalidRequestError(
                f"{where} nests repetitions up to {nested} times (nested bounds multiply), "
                f"above omlx's limit of {MAX_REPEAT} for enforced lengths",
                param=param,
            )
        frames[-1][0] = max(frames[-1][0], nested)
        frames[-1][1] += max(inner[1], 1) * bound[0] if kind == ")" else bound[0]
    return sum(frame[1] for frame in frames)


def regex_tokens(pattern: str) -> Iterator[tuple[str, int]]:
    """("(", ")" or "atom", end index) for each group edge and atom."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            yield "atom", i
        elif c == "[":
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"  # a leading ']' is literal
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            yield "atom", j + 1
            i = j + 1
        elif c in "()":
            yield c, i + 1
            i += 1
        else:
            yield "atom", i + 1
            i += 1


def _quantifier_after(pattern: str, at: int) -> tuple[int, str] | None:
    """The largest count of a ``{n}``, ``{n,}`` or ``{n,m}`` at ``at`` (``*``/``+``
    add no states, so they count as one), with its text."""
    match = _QUANTIFIER.match(pattern, at)
    if match is None:
        return None
    low, comma, high = match.groups()
    return int(high) if comma and high else int(low), match.group(0)


def _ebnf_bounds(source: str) -> Iterator[tuple[int, str]]:
    """Each ``{n,m}`` range outside string literals and character classes."""
    for match in _QUANTIFIER.finditer(_without_strings(source)):
        low, comma, high = match.groups()
        yield (int(high) if comma and high else int(low)), match.group(0)


def _without_strings(source: str) -> str:
    """EBNF with its string literals and character classes blanked out."""
    return re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', '""', source)
