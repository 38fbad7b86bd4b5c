"""`build.py app`: py2app on macOS, then the grammar packages and the strip step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from omlx_build.grammar import install_grammar, pip_installer
from omlx_build.plist import info_plist
from omlx_build.project import ROOT, BuildError, BundleConfig, grammar_pins
from omlx_build.strip import strip_packages


def py2app_options(config: BundleConfig) -> dict[str, Any]:
    return {
        "argv_emulation": False,
        "iconfile": str(config.icon),
        "plist": info_plist(config),
        "packages": list(config.py2app_packages),
        "excludes": list(config.py2app_excludes),
        "resources": [str(r) for r in config.resources],
        "arch": config.arch,
        "semi_standalone": False,
        "site_packages": False,
        "optimize": 0,
    }


def bundle_site_packages(app: Path) -> Path:
    """The folder on the bundle's sys.path where py2app put whole packages."""
    lib = app / "Contents" / "Resources" / "lib"
    found = sorted(p for p in lib.glob("python3*") if p.is_dir())
    if not found:
        raise BuildError(f"no lib/python3.x folder in {lib}: did py2app finish?")
    return found[-1]


def build_app(config: BundleConfig, dist: Path, work: Path, sign: str | None = None) -> Path:
    if sys.platform != "darwin":
        raise BuildError(
            "py2app builds omlx.app on macOS only; here run `python build.py check` "
            "or `python build.py dmg-layout`"
        )
    from setuptools import setup

    stage = work / "py2app"
    stage.mkdir(parents=True, exist_ok=True)
    # setup() reads a pyproject.toml in the working directory; ours declares dependencies,
    # which py2app refuses, so run it from a folder without one.
    cwd = Path.cwd()
    os.chdir(stage)
    sys.path.insert(0, str(ROOT))
    try:
        setup(
            name=config.name,
            version=config.version,
            app=[str(config.entry)],
            options={"py2app": py2app_options(config)},
            script_args=["py2app", "--dist-dir", str(dist), "--bdist-base", str(work / "bdist")],
        )
    finally:
        os.chdir(cwd)
    app = dist / f"{config.name}.app"
    site = bundle_site_packages(app)
    install_grammar(site, grammar_pins(), pip_installer())
    removed = strip_packages(site, config.strip)
    print(f"stripped from the bundle: {', '.join(removed) or 'nothing'}")
    if sign:
        codesign(app, sign)
    return app


def codesign(app: Path, identity: str) -> None:
    """Hardened-runtime signature, inside out (nested .so/.dylib first via --deep)."""
    entitlements = ROOT / "packaging" / "entitlements.plist"
    subprocess.run(
        ["codesign", "--force", "--deep", "--timestamp", "--options", "runtime",
         "--entitlements", str(entitlements), "--sign", identity, str(app)],
        check=True,
    )  # fmt: skip
    subprocess.run(["codesign", "--verify", "--deep", "--strict", str(app)], check=True)
