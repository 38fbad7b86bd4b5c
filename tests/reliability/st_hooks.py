"""Schemathesis hooks (loaded through SCHEMATHESIS_HOOKS by test_schema_fuzz.py).

Random model names all end in a 404 before any real work; half the generated
cases name the real model instead, so fuzzed sampling fields, prompts and
settings reach the engine and the admin routes of a loaded model.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import strategies as st

MODEL = "tiny-llama"


@schemathesis.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy:
    if isinstance(body, dict) and "model" in body:  # negative cases may send anything
        return st.sampled_from([MODEL, body["model"]]).map(lambda m: {**body, "model": m})
    return st.just(body)


@schemathesis.hook
def flatmap_path_parameters(
    context: schemathesis.HookContext, path_parameters: dict[str, Any]
) -> st.SearchStrategy:
    if isinstance(path_parameters, dict) and "name" in path_parameters:
        names = st.sampled_from([MODEL, path_parameters["name"]])
        return names.map(lambda n: {**path_parameters, "name": n})
    return st.just(path_parameters)
