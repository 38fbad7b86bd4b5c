"""`build.py app`: py2app on macOS, then mlx, the grammar packages, strip, version, signing."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omlx_build.app_check import app_problems
from omlx_build.bundle_layout import bake_version, bundle_site_packages
from omlx_build.copy_whole import copy_whole
from omlx_build.grammar import Installer, install_grammar, pip_installer
from omlx_build.install import verified_grammar_installer
from omlx_build.plist import info_plist
from omlx_build.project import ROOT, BuildError, BundleConfig, grammar_pins
from omlx_build.signing import ADHOC, sign_app
from omlx_build.strip import strip_debug_symbols, strip_packages
from omlx_build.wheelset import wheel_set


def py2app_options(config: BundleConfig) -> dict[str, Any]:
    return {
        "argv_emulation": False,
        "iconfile": str(config.icon),
        "plist": info_plist(config),
        "packages": list(config.py2app_packages),
        "includes": list(config.py2app_includes),
        "excludes": list(config.py2app_excludes),
        "resources": [str(r) for r in config.resources],
        "arch": config.arch,
        "semi_standalone": False,
        "site_packages": False,
        "optimize": 0,
    }


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
    # The grammar wheels `build.py verify` checked (cached), not whatever suits this Mac.
    finish_bundle(app, config, installer=verified_grammar_installer(wheel_set(config, ROOT)))
    # py2app signed ad hoc before the steps above changed Contents/Resources, which
    # broke that signature: sign again (ad hoc when no identity is given) after the last
    # change.
    sign_app(app, sign or ADHOC)
    return app


def finish_bundle(
    app: Path,
    config: BundleConfig,
    search_path: Sequence[str] | None = None,
    installer: Installer | None = None,
) -> None:
    """Everything after py2app that changes the bundle, then the checks it must pass.

    ``search_path`` is where the [copy] packages come from (the build environment's
    sys.path by default); ``installer`` installs the grammar packages (pip by default).
    """
    site = bundle_site_packages(app)
    for name in config.copy_packages:
        print(f"copied whole: {copy_whole(name, site, search_path)}")
    install_grammar(site, grammar_pins(), installer or pip_installer())
    removed = strip_packages(site, config.strip) + strip_debug_symbols(site)
    print(f"stripped from the bundle: {', '.join(removed) or 'nothing'}")
    bake_version(site, config.version)
    problems = app_problems(app, config)
    if problems:
        raise BuildError("the built app is not right:\n  " + "\n  ".join(problems))
