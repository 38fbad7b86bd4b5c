"""Where things sit inside a built omlx.app, and the version baked into it."""

from __future__ import annotations

import plistlib
import re
from pathlib import Path
from typing import Any

from omlx_build.project import BuildError

# py2app does not copy the package metadata of an editable (PEP 660) install, so
# `importlib.metadata.version("omlx")` would fail in the bundle: the build writes the
# version here and omlx/__init__.py reads it first.
VERSION_MODULE = "omlx/_version.py"


def bundle_site_packages(app: Path) -> Path:
    """The folder on the bundle's sys.path where py2app put whole packages."""
    lib = app / "Contents" / "Resources" / "lib"
    found = sorted(p for p in lib.glob("python3*") if p.is_dir())
    if not found:
        raise BuildError(f"no lib/python3.x folder in {lib}: did py2app finish?")
    return found[-1]


def app_plist(app: Path) -> dict[str, Any]:
    with (app / "Contents" / "Info.plist").open("rb") as f:
        return plistlib.load(f)


def bake_version(site_packages: Path, version: str) -> Path:
    path = site_packages / VERSION_MODULE
    if not path.parent.is_dir():
        raise BuildError(f"no omlx package in {site_packages}: did py2app copy it?")
    path.write_text(f'"""Written by build.py."""\n\n__version__ = "{version}"\n')
    return path


def baked_version(site_packages: Path) -> str | None:
    path = site_packages / VERSION_MODULE
    if not path.is_file():
        return None
    match = re.search(r'^__version__ = "([^"]+)"$', path.read_text(), re.MULTILINE)
    return match.group(1) if match else None
