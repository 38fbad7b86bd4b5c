"""The text checks the body guard runs before any route parses a body."""

from __future__ import annotations

import json

import pytest

from omlx.api.body_guard import check_json_text
from omlx.errors import InvalidRequestError


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "plain ascii"}',
        '{"prompt": "caf\u00e9 \U0001f600"}'.encode(),  # raw UTF-8, astral included
        json.dumps({"prompt": "\U0001f600"}).encode(),  # ensure_ascii: a surrogate pair
        b'{"prompt": "\\\\ud800"}',  # an escaped backslash, then the text "ud800"
        b"[" * 400 + b"]" * 400,  # deep, but not too deep for the parser
        b"not json at all \\ud800",  # the route reports bad JSON in its own words
        b"",
    ],
)
def test_text_any_route_could_use_passes(body: bytes) -> None:
    check_json_text(body)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b'{"prompt": "\xff"}', "UTF-8"),
        (b'{"prompt": "\xed\xa0\x80"}', "UTF-8"),  # CESU-8 surrogate
        (b'{"prompt": "\\ud800"}', "surrogate"),
        (b'{"prompt": "\\\\\\udfff"}', "surrogate"),  # escaped backslash, then a lone low half
        (b'{"a": ["x", {"k\\udc00": 1}]}', "surrogate"),  # in a key, nested
        (b'{"prompt": "\\ude00\\ud83d"}', "surrogate"),  # a pair in the wrong order
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    ],
)
def test_text_no_route_could_use_is_refused_with_the_reason(body: bytes, named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        check_json_text(body)
