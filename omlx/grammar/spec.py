"""What a request asks the output to follow; pure, no xgrammar import.

The constructors check the caps of ``limits`` first, so no constraint over them
reaches the compiler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from omlx.grammar import limits

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

    @classmethod
    def json_schema(cls, schema: dict[str, Any], *, strict: bool, param: str) -> GrammarSpec:
        limits.check_json_schema(schema, param)
        return cls("json_schema", json.dumps(schema, sort_keys=True), strict, param)

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
