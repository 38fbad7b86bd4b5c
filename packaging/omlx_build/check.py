"""`build.py check`: everything about the bundle that can be validated on any OS."""

from __future__ import annotations

import plistlib
import re
from pathlib import Path

from omlx_build.app_build import py2app_options
from omlx_build.plist import info_plist, plist_problems
from omlx_build.project import ROOT, BuildError, BundleConfig, grammar_pins, load_config

WORKFLOW = Path(".github/workflows/macos-dmg.yml")
ENTITLEMENTS = Path("packaging/entitlements.plist")
# Imports of the shell from the server package (the server must never depend on it).
_IMPORTS_APP = re.compile(r"^\s*(from\s+app(\.|\s)|import\s+app(\.|\s|$))", re.MULTILINE)


def icns_problems(path: Path) -> list[str]:
    """An .icns file: magic, a length that matches the file, and at least one PNG image."""
    if not path.is_file():
        return [f"icon {path} is missing"]
    data = path.read_bytes()
    if data[:4] != b"icns" or int.from_bytes(data[4:8], "big") != len(data):
        return [f"icon {path} is not a valid .icns file"]
    if b"\x89PNG" not in data:
        return [f"icon {path} holds no PNG image"]
    return []


def _config_problems(config: BundleConfig) -> list[str]:
    problems = []
    if not re.fullmatch(r"\d+\.\d+\.\d+", config.version):
        problems.append(f"pyproject version {config.version!r} is not x.y.z")
    if not config.entry.is_file():
        problems.append(f"entry script {config.entry} is missing")
    for resource in config.resources:
        if not resource.exists():
            problems.append(f"resource {resource} is missing")
    if (ROOT / "web").exists() and not (ROOT / "web" / "index.html").is_file():
        problems.append("web/index.html is missing (the admin panel)")
    for heavy in ("torch", "triton"):
        if heavy not in config.py2app_excludes:
            problems.append(f"py2app excludes should name {heavy}")
        if heavy not in config.strip:
            problems.append(f"the strip list should name {heavy}")
    return problems


def _layering_problems(root: Path) -> list[str]:
    return [
        f"{path.relative_to(root)} imports app/ (the server must not depend on the shell)"
        for path in sorted((root / "omlx").rglob("*.py"))
        if _IMPORTS_APP.search(path.read_text(encoding="utf-8"))
    ]


def run_check(root: Path = ROOT) -> list[str]:
    try:
        config = load_config(root)
        pins = grammar_pins(root)
    except (BuildError, KeyError, OSError) as exc:
        return [f"cannot read the bundle configuration: {exc}"]
    problems = _config_problems(config)
    plist = info_plist(config)
    problems += plist_problems(plist, config)
    plistlib.dumps(py2app_options(config)["plist"])  # raises if not serialisable
    problems += icns_problems(config.icon)
    if not all(re.fullmatch(r"\d+(\.\d+)*", v) for v in pins.values()):
        problems.append(f"grammar pins must be exact versions: {pins}")
    try:
        entitlements = plistlib.loads((root / ENTITLEMENTS).read_bytes())
        if entitlements.get("com.apple.security.cs.disable-library-validation") is not True:
            problems.append(f"{ENTITLEMENTS} must allow loading the wheels' libraries")
    except (OSError, plistlib.InvalidFileException) as exc:
        problems.append(f"{ENTITLEMENTS} is unreadable: {exc}")
    if not (root / WORKFLOW).is_file():
        problems.append(f"{WORKFLOW} is missing")
    problems += _layering_problems(root)
    return problems
