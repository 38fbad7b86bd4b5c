"""A new model folder's name, checked before anything is written. Pure."""

from __future__ import annotations

from omlx.errors import InvalidRequestError

MAX_NAME_LENGTH = 200


def check_folder_name(name: object, param: str) -> str:
    """``name`` if it is one safe, visible folder name; a 400 on ``param`` otherwise."""
    problem = None
    if not isinstance(name, str) or not name.strip():
        problem = "must be a non-empty string"
    elif len(name) > MAX_NAME_LENGTH:
        problem = f"must be at most {MAX_NAME_LENGTH} characters"
    elif "/" in name or "\\" in name:
        problem = "must be a single folder name (no '/' or '\\')"
    elif name.startswith("."):
        problem = "must not start with '.' (hidden folders are not models; '..' escapes)"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "must not contain control characters"
    elif name != name.strip():
        problem = "must not start or end with spaces"
    if problem:
        raise InvalidRequestError(f"'{param}' {name!r} {problem}", param=param)
    return str(name)
