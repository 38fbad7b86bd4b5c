"""What a request asks the output to follow; pure, no xgrammar import."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]


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
        return cls("json_schema", json.dumps(schema, sort_keys=True), strict, param)

    @classmethod
    def choice(cls, options: list[str], param: str) -> GrammarSpec:
        return cls("choice", json.dumps(options), False, param)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return (self.kind, self.source, self.strict)

    def choice_ebnf(self) -> str:
        """An EBNF grammar matching exactly one of the choices."""
        options = json.loads(self.source)
        return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
