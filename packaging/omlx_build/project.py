"""Facts about the project the build needs: version, grammar pins, bundle config."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE_TOML = ROOT / "packaging" / "bundle.toml"


class BuildError(Exception):
    """A build step cannot go on; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class BundleConfig:
    name: str
    bundle_id: str
    version: str
    entry: Path
    icon: Path
    minimum_macos: str
    arch: str
    copyright: str
    resources: tuple[Path, ...]
    py2app_packages: tuple[str, ...]
    py2app_includes: tuple[str, ...]
    py2app_excludes: tuple[str, ...]
    # Copied whole from site-packages after py2app (see bundle.toml [copy]).
    copy_packages: tuple[str, ...]
    # Exact build-tool pins: {"py2app": "0.28.10", "setuptools": "70.3.0"}.
    build_tools: dict[str, str]
    strip: tuple[str, ...]
    # The Python the bundle is built with (bundle.toml [build] python), e.g. "3.12".
    python: str
    # Packages with no macOS wheel that `build.py verify` accepts as pure-Python sdists.
    sdist_ok: tuple[str, ...]
    # The release feed the app checks unless the user sets another (Info.plist
    # OMLXUpdateFeed): the release workflow passes the repository's own releases in
    # OMLX_UPDATE_FEED; a local build has none, so it never checks on its own.
    update_feed: str = ""


def project_version(root: Path = ROOT) -> str:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def grammar_pins(root: Path = ROOT) -> dict[str, str]:
    """xgrammar and apache-tvm-ffi pins, read from setup.sh so there is one source."""
    text = (root / "setup.sh").read_text()
    match = re.search(r"^GRAMMAR_PKGS=\(([^)]*)\)", text, re.MULTILINE)
    if match is None:
        raise BuildError("setup.sh has no GRAMMAR_PKGS=(...) line")
    pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', match.group(1)))
    if set(pins) != {"xgrammar", "apache-tvm-ffi"}:
        raise BuildError(f"GRAMMAR_PKGS should pin xgrammar and apache-tvm-ffi, got {pins}")
    return pins


def load_config(root: Path = ROOT) -> BundleConfig:
    data = tomllib.loads((root / "packaging" / "bundle.toml").read_text())
    app = data["app"]
    build = dict(data["build"])
    python = build.pop("python")  # the rest are the build-tool pins
    return BundleConfig(
        name=app["name"],
        bundle_id=app["bundle_id"],
        version=project_version(root),
        entry=root / app["entry"],
        icon=root / app["icon"],
        minimum_macos=app["minimum_macos"],
        arch=app["arch"],
        copyright=app["copyright"],
        resources=tuple(root / r for r in app["resources"]),
        py2app_packages=tuple(data["py2app"]["packages"]),
        py2app_includes=tuple(data["py2app"]["includes"]),
        py2app_excludes=tuple(data["py2app"]["excludes"]),
        copy_packages=tuple(data["copy"]["packages"]),
        build_tools=build,
        strip=tuple(data["strip"]["packages"]),
        python=python,
        sdist_ok=tuple(data.get("verify", {}).get("sdist_ok", ())),
        update_feed=os.environ.get("OMLX_UPDATE_FEED", "").strip(),
    )
