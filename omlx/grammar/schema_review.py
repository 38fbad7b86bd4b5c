"""Which JSON Schema keywords the grammar enforces; pure, no xgrammar import.

xgrammar 0.2.8 silently ignores some keywords (``uniqueItems``, ``contains``,
``not``, ``if``, ``dependentRequired``, number ``multipleOf``, anything beside
``$ref`` / ``enum`` / ``anyOf``, ``minLength`` beside ``pattern``...), so a
constrained output could break its schema. ``review_schema`` rewrites what can
be said another way (formats as stricter patterns, a length folded into a
one-class pattern, siblings pushed into ``anyOf`` branches, ``allOf`` merged)
and lists the rest, each with its JSON path, for the caller to refuse (strict
requests) or report (a response header and a log line).
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omlx.errors import InvalidRequestError
from omlx.grammar.limits import regex_tokens, subschemas
from omlx.grammar.schema_formats import (
    ENFORCED_FORMATS,
    FORMAT_LENGTHS,
    FORMAT_PATTERNS,
    STANDARD_FORMATS,
)

# Keywords that constrain a value (the rest are annotations or unknown, which
# validators ignore too).
_VALIDATION_WORDS = (
    "type enum const multipleOf maximum exclusiveMaximum minimum exclusiveMinimum "
    "maxLength minLength pattern format maxItems minItems uniqueItems maxContains "
    "minContains contains items prefixItems additionalItems unevaluatedItems "
    "maxProperties minProperties required dependentRequired properties "
    "patternProperties additionalProperties unevaluatedProperties propertyNames "
    "dependentSchemas dependencies allOf anyOf oneOf not if then else $ref $dynamicRef"
)
VALIDATION = frozenset(_VALIDATION_WORDS.split())
# Keywords xgrammar ignores wherever they appear.
_NEVER: tuple[str, ...] = (
    "not",
    "if",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "$dynamicRef",
    "additionalItems",
)
# Subschemas xgrammar never looks at: nothing inside them is reported twice.
_IGNORED_SUBTREES = frozenset({"not", "if", "then", "else", "contains", "dependentSchemas"})
# Keywords whose meaning depends on others beside them in the same schema.
_RELATIVE_TO = (
    (("additionalProperties", "unevaluatedProperties"), ("properties", "patternProperties")),
    (("items", "unevaluatedItems"), ("prefixItems",)),
)
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# xgrammar's bounds on an enforced integer multipleOf (json_schema_converter.cc).
_MULTIPLE_OF_MAX = 1024
_MULTIPLE_OF_RANGE_MAX = 9999
# A pattern that is one character class repeated: a length can be folded into it.
# An optional group: xgrammar 0.2.8 lets "(xb+)?" match "b" (checked), "(xb+|)" not.
_OPTIONAL = re.compile(r"(?:\?|\{0,1\})(?![?+])")
_ONE_CLASS = re.compile(
    r"\^?(?P<atom>\[(?:\\.|[^\]\\])+\]|\\[dwsDWS]|\.|[A-Za-z0-9 _-])"
    r"(?:(?P<star>[*+])|\{(?P<low>\d+)(?P<comma>,(?P<high>\d*))?\})\$?"
)


UNENFORCED_HEADER = "X-Omlx-Unenforced-Schema-Keywords"


@dataclass(frozen=True, slots=True)
class SchemaReview:
    # The schema to compile: the request's, rewritten so the grammar enforces more.
    schema: dict[str, Any]
    # "<keyword> at <JSON path>" for each keyword the grammar cannot enforce.
    unenforced: tuple[str, ...]


def review_schema(schema: dict[str, Any]) -> SchemaReview:
    """The schema the grammar should compile, and what it will not enforce.
    Call it after ``limits.check_json_schema`` (which bounds the depth)."""
    rewritten = copy.deepcopy(schema)
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(rewritten, "$")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            found += (f"{keyword} at {path}" for keyword in _review_node(node, rewritten))
            walked = {k: v for k, v in node.items() if k not in _IGNORED_SUBTREES}
            stack.extend(reversed(list(subschemas(walked, path))))
    return SchemaReview(rewritten, tuple(found))


def refuse_unenforced(unenforced: tuple[str, ...], param: str) -> None:
    """InvalidRequestError naming the keywords a strict request asked for in vain."""
    if not unenforced:
        return
    listed = "; ".join(unenforced[:8]) + (
        f" (and {len(unenforced) - 8} more)" * (len(unenforced) > 8)
    )
    raise InvalidRequestError(
        f"{param}: the grammar cannot enforce {listed}, so a strict schema is refused; "
        "remove or rewrite those keywords, or ask without strict (strict: false, a tool "
        "without strict) to have the schema accepted with them unenforced and listed in "
        f"the {UNENFORCED_HEADER} response header",
        param=param,
        code="unsupported_schema_keyword",
    )


def _review_node(node: dict[str, Any], root: dict[str, Any]) -> Iterator[str]:
    """Rewrite ``node`` in place; yield the keywords left unenforced."""
    yield from (k for k in _NEVER if k in node)
    if node.get("items") is not None and isinstance(node["items"], list):
        yield "items"  # the draft-7 tuple form
    if "$ref" in node:
        # xgrammar follows the reference and ignores every keyword beside it.
        yield from (k for k in node if k in VALIDATION and k not in ("$ref", *_NEVER))
        return
    if "const" in node or "enum" in node:
        # Only the listed values are generated; siblings are not checked.
        skip = ("const", "enum", "type", *_NEVER)
        yield from (k for k in node if k in VALIDATION and k not in skip)
        return
    if "allOf" in node:
        _merge_all_of(node)
    if "allOf" in node:
        yield "allOf"  # a conflict left it unmerged: xgrammar does not intersect
    if "anyOf" in node or "oneOf" in node:
        yield from _review_union(node, root)
    elif "allOf" not in node:
        yield from _review_typed(node)


def _review_union(node: dict[str, Any], root: dict[str, Any]) -> Iterator[str]:
    kind = "anyOf" if "anyOf" in node else "oneOf"
    if "anyOf" in node and "oneOf" in node:
        yield "oneOf"  # xgrammar takes the anyOf only
    branches = node[kind]
    siblings = {
        k: v for k, v in node.items() if k in VALIDATION and k not in ("anyOf", "oneOf", "allOf")
    }
    if siblings and isinstance(branches, list):
        merged = [_merge(b, siblings) for b in branches]
        if all(m is not None for m in merged):
            node[kind] = merged  # (A or B) and S == (A and S) or (B and S)
            for k in siblings:
                del node[k]
        else:
            yield from siblings
    if kind == "oneOf" and not _disjoint(node["oneOf"], root):
        yield "oneOf"  # generated as anyOf: a value matching two branches breaks it


def _merge_all_of(node: dict[str, Any]) -> None:
    """Fold ``allOf`` into its node when no keyword appears twice with different values."""
    parts = node["allOf"]
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        return
    merged: dict[str, Any] | None = {k: v for k, v in node.items() if k != "allOf"}
    for part in parts:
        merged = _merge(part, merged) if merged is not None else None
    if merged is not None:
        node.clear()
        node.update(merged)


def _merge(branch: Any, extra: dict[str, Any]) -> dict[str, Any] | None:
    """``branch`` and ``extra`` as one schema (both must hold); None on a conflict."""
    if branch is True:
        return dict(extra)
    if not isinstance(branch, dict):
        return None
    if _relative_clash(branch, extra) or _relative_clash(extra, branch):
        return None
    merged = dict(branch)
    for key, value in extra.items():
        mine = merged.get(key)
        if key == "required" and isinstance(mine, list) and isinstance(value, list):
            merged[key] = value + [n for n in mine if n not in value]
        elif key == "properties" and isinstance(mine, dict) and isinstance(value, dict):
            if any(mine[n] != value[n] for n in mine.keys() & value.keys()):
                return None
            merged[key] = {**value, **mine}  # the earlier keys first: models follow the order
        elif key in merged and merged[key] != value:
            return None
        else:
            merged[key] = value
    return merged


def _relative_clash(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``b`` adds names or positions that a keyword of ``a`` counts relative
    to (additionalProperties to properties, items to prefixItems): merging would
    change what that keyword allows."""
    return any(
        any(k in a for k in relative) and any(k in b for k in base)
        for relative, base in _RELATIVE_TO
    )


def _review_typed(node: dict[str, Any]) -> Iterator[str]:
    types = node.get("type")
    kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if not kinds:
        # Without a type xgrammar infers objects and arrays, not strings or numbers.
        yield from (k for k in (*_STRING_KEYWORDS, *_NUMBER_KEYWORDS) if k in node)
    if "string" in kinds:
        yield from _review_string(node)
    if "integer" in kinds and "number" not in kinds:
        yield from _review_integer(node)
    elif "number" in kinds and "multipleOf" in node:
        yield "multipleOf"  # ignored for type number
    yield from _review_array(node)
    yield from _review_object(node)


def _review_string(node: dict[str, Any]) -> Iterator[str]:
    yield from _review_string_keywords(node)
    if isinstance(node.get("pattern"), str):
        node["pattern"] = optional_groups_as_alternatives(node["pattern"])


def optional_groups_as_alternatives(pattern: str) -> str:
    """``pattern`` with each ``(A)?`` written ``(A|)``: the same language, which
    xgrammar compiles right."""
    parts, last = [], 0
    for kind, end in regex_tokens(pattern):
        quantifier = _OPTIONAL.match(pattern, end) if kind == ")" else None
        if quantifier is not None:
            parts += [pattern[last : end - 1], "|)"]
            last = quantifier.end()
    return "".join(parts) + pattern[last:]


def _review_string_keywords(node: dict[str, Any]) -> Iterator[str]:
    fmt, pattern = node.get("format"), node.get("pattern")
    if isinstance(fmt, str):
        if fmt not in ENFORCED_FORMATS:
            if fmt in STANDARD_FORMATS:
                yield "format"
            del node["format"]  # xgrammar would ignore it anyway; keep the rest enforced
        else:
            if fmt in FORMAT_PATTERNS:
                del node["format"]
                node["pattern"] = FORMAT_PATTERNS[fmt]
            yield from _lengths_beside(node, FORMAT_LENGTHS.get(fmt))
            node.pop("minLength", None)  # xgrammar ignores them beside a format
            node.pop("maxLength", None)
            if pattern is not None:
                yield "pattern"  # xgrammar enforces the format and ignores the pattern
            return
    if isinstance(pattern, str) and ("minLength" in node or "maxLength" in node):
        folded = _fold_length(pattern, node.get("minLength", 0), node.get("maxLength"))
        if folded is None:
            yield from (k for k in ("minLength", "maxLength") if k in node)
        else:
            node["pattern"] = folded
            node.pop("minLength", None)  # xgrammar ignores them beside a pattern
            node.pop("maxLength", None)


def _lengths_beside(node: dict[str, Any], lengths: tuple[int, int] | None) -> Iterator[str]:
    """minLength/maxLength beside a format: fine only when every value fits them."""
    low, high = lengths or (None, None)
    if "minLength" in node and (low is None or node["minLength"] > low):
        yield "minLength"
    if "maxLength" in node and (high is None or node["maxLength"] < high):
        yield "maxLength"


def _fold_length(pattern: str, min_length: Any, max_length: Any) -> str | None:
    """``^X{lo,hi}$`` for a pattern that is one class X repeated, within the lengths;
    None when the pattern is anything else."""
    match = _ONE_CLASS.fullmatch(pattern)
    if match is None or not isinstance(min_length, int):
        return None
    if match["star"]:
        low, high = (1 if match["star"] == "+" else 0), None
    else:
        low = int(match["low"])
        high = int(match["high"]) if match["comma"] and match["high"] else None
        high = low if not match["comma"] else high
    # A full match of X{lo,hi} (lo at least the pattern's) also matches the pattern
    # when searched, anchored or not.
    low = max(low, min_length)
    if isinstance(max_length, int):
        high = max_length if high is None else min(high, max_length)
    if high is not None and low > high:
        return None
    return f"^{match['atom']}{{{low},{'' if high is None else high}}}$"


def _review_integer(node: dict[str, Any]) -> Iterator[str]:
    # Integers only: a fractional bound becomes the nearest whole one inside it.
    for key, rounding in (("minimum", math.ceil), ("maximum", math.floor)):
        value = node.get(key)
        if isinstance(value, float) and math.isfinite(value):
            node[key] = int(rounding(value))
    step = node.get("multipleOf")
    if step is None:
        return
    if not (isinstance(step, int | float) and step == int(step) and 0 < step <= _MULTIPLE_OF_MAX):
        yield "multipleOf"
        return
    low = _bound(node, "minimum", "exclusiveMinimum")
    high = _bound(node, "maximum", "exclusiveMaximum")
    if (low is None) != (high is None) or (
        low is not None and high is not None and high - low > _MULTIPLE_OF_RANGE_MAX
    ):
        yield "multipleOf"  # xgrammar drops it beside one bound or a wide range


def _bound(node: dict[str, Any], inclusive: str, exclusive: str) -> float | None:
    values = [v for k in (inclusive, exclusive) if isinstance(v := node.get(k), int | float)]
    return values[0] if values else None


def _review_array(node: dict[str, Any]) -> Iterator[str]:
    max_items = node.get("maxItems")
    if node.get("uniqueItems") is True and not (isinstance(max_items, int) and max_items <= 1):
        yield "uniqueItems"
    if "unevaluatedItems" in node:
        if "items" not in node and not _has_applicators(node):
            node["items"] = node.pop("unevaluatedItems")  # the same, with nothing else
        else:
            yield "unevaluatedItems"


def _review_object(node: dict[str, Any]) -> Iterator[str]:
    yield from _declare_required(node)
    names = node.get("propertyNames")
    if isinstance(names, dict) and "type" not in names:
        names["type"] = "string"  # what xgrammar assumes; lets the string review run
    if (
        "patternProperties" in node
        and "properties" in node
        and node.get("additionalProperties") is not False
    ):
        yield "patternProperties"  # names matching a pattern get any value then
    if "unevaluatedProperties" in node:
        if "additionalProperties" not in node and not _has_applicators(node):
            node["additionalProperties"] = node.pop("unevaluatedProperties")
        else:
            yield "unevaluatedProperties"


def _declare_required(node: dict[str, Any]) -> Iterator[str]:
    """Required names missing from ``properties`` (xgrammar would not generate them)
    declared there with the schema their value has anyway."""
    required, props = node.get("required"), node.get("properties", {})
    if not isinstance(required, list) or not isinstance(props, dict):
        return
    missing = [n for n in required if isinstance(n, str) and n not in props]
    extra = node.get("additionalProperties", True)
    if not missing:
        return
    if "patternProperties" in node or extra is False:
        yield "required"  # a pattern would decide the value's schema; false allows none
        return
    node["properties"] = {**props, **{n: extra if isinstance(extra, dict) else {} for n in missing}}


def _has_applicators(node: dict[str, Any]) -> bool:
    return any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas"))


def _disjoint(branches: Any, root: dict[str, Any]) -> bool:
    """Whether no value can match two branches: different types, or one required
    property whose const/enum values differ (a tagged union)."""
    if not isinstance(branches, list):
        return False
    resolved = [_resolve(b, root) for b in branches]
    pairs = [(a, b) for i, a in enumerate(resolved) for b in resolved[i + 1 :]]
    return all(_types_disjoint(a, b) or _tags_disjoint(a, b) for a, b in pairs)


def _resolve(branch: Any, root: dict[str, Any]) -> dict[str, Any]:
    ref = branch.get("$ref") if isinstance(branch, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return branch if isinstance(branch, dict) else {}
    target: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        target = target.get(part) if isinstance(target, dict) else None
    return target if isinstance(target, dict) else {}


def _type_set(schema: dict[str, Any]) -> set[str] | None:
    types = schema.get("type")
    kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if kinds is not None and "number" in kinds:
        kinds.add("integer")
    return kinds


def _types_disjoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    kinds_a, kinds_b = _type_set(a), _type_set(b)
    return kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b


def _tags_disjoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    shared = set(_tags(a)) & set(_tags(b))
    return any(not set(_tags(a)[name]) & set(_tags(b)[name]) for name in shared)


def _tags(schema: dict[str, Any]) -> dict[str, list[str]]:
    """Required properties held to listed values: name -> those values (as JSON text)."""
    props = schema.get("properties")
    required = schema.get("required")
    if not isinstance(props, dict) or not isinstance(required, list):
        return {}
    tags: dict[str, list[str]] = {}
    for name in required:
        prop = props.get(name)
        if isinstance(prop, dict) and ("const" in prop or isinstance(prop.get("enum"), list)):
            values = [prop["const"]] if "const" in prop else prop["enum"]
            tags[name] = [json.dumps(v, sort_keys=True) for v in values]
    return tags
