"""Output folder names for oQ models: validation, defaults, temp folders. Pure."""

from __future__ import annotations

from pathlib import Path

from omlx.errors import InvalidRequestError, OutputExistsError

MAX_NAME_LENGTH = 200


def check_output_name(name: str) -> str:
    """``name`` if it is one safe folder name; InvalidRequestError (400) otherwise."""
    problem = None
    if not name or not name.strip():
        problem = "must not be empty"
    elif len(name) > MAX_NAME_LENGTH:
        problem = f"must be at most {MAX_NAME_LENGTH} characters"
    elif "/" in name or "\\" in name:
        problem = "must be a single folder name (no '/' or '\\')"
    elif name.startswith("."):
        problem = "must not start with '.' (hidden folders are skipped, '..' escapes)"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "must not contain control characters"
    elif name != name.strip():
        problem = "must not start or end with spaces"
    if problem:
        raise InvalidRequestError(f"output_name {name!r} {problem}", param="output_name")
    return name


def default_output_name(model: str, level: str) -> str:
    """``<source>-oQ4`` for a folder ``org/source`` or ``source``."""
    return f"{model.rsplit('/', 1)[-1]}-{level}"


def check_free(dest: Path) -> Path:
    if dest.exists() or dest.is_symlink():
        raise OutputExistsError(
            f"a model folder named '{dest.name}' already exists in {dest.parent}; "
            "choose another output_name",
            param="output_name",
        )
    return dest


def temp_dir_for(dest: Path) -> Path:
    """Where a job writes before the final rename: hidden, so discovery skips it."""
    return dest.parent / f".{dest.name}.oq-partial"
