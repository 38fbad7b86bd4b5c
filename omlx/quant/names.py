"""Output folder names for oQ models: validation, defaults, temp folders. Pure."""

from __future__ import annotations

from pathlib import Path

from omlx.errors import OutputExistsError
from omlx.models.folder_name import check_folder_name


def check_output_name(name: str) -> str:
    """``name`` if it is one safe folder name; InvalidRequestError (400) otherwise."""
    return check_folder_name(name, "output_name")


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
