"""What a request asks the output to follow; pure, no xgrammar import.

The constructors check the caps of ``limits`` first, so no constraint over them
reaches the compiler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from omlx.grammar import limits
from omlx.grammar.schema_review import refuse_unenforced, review_schema

Kind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
_WHAT: dict[str, str] = {
    "json_schema": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice list",
}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: Kind
    # Canonical text of the constraint (sorted-key JSON for schemas and choices).
    source: str = ""
    strict: bool = False
    # The request field it came from, for error messages.
    param: str = "response_format"
    # Schema keywords the grammar cannot enforce ("uniqueItems at $.tags").
    unenforced: tuple[str, ...] = ()

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any], *, strict: bool, param: str, refuse: bool | None = None
    ) -> GrammarSpec:
        """The schema as the grammar enforces it; InvalidRequestError naming the
        keywords it cannot enforce when ``refuse`` (by default: when ``strict``)."""
        limits.check_json_schema(schema, param)
        review = review_schema(schema)
        # Again on the rewrite: folded lengths and formats add pattern repetitions.
        limits.check_json_schema(review.schema, param)
        if strict if refuse is None else refuse:
            refuse_unenforced(review.unenforced, param)
        source = json.dumps(review.schema, sort_keys=True)
        return cls("json_schema", source, strict, param, review.unenforced)

    @classmethod
    def choice(cls, options: list[str], param: str) -> GrammarSpec:
        limits.check_choices(options, param)
        return cls("choice", json.dumps(options), False, param)

    @classmethod
    def regex(cls, source: str, param: str) -> GrammarSpec:
        limits.check_regex(source, param)
        return cls("regex", source, False, param)

    @classmethod
    def ebnf(cls, source: str, param: str) -> GrammarSpec:
        limits.check_ebnf(source, param)
        return cls("grammar", source, False, param)

    @property
    def what(self) -> str:
        """What the constraint is called in error messages."""
        return _WHAT[self.kind]

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return (self.kind, self.source, self.strict)

    def choice_ebnf(self) -> str:
        """An EBNF grammar matching exactly one of the choices."""
        options = json.loads(self.source)
        return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
