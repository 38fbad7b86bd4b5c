"""`build.py install-verified`: the build gets exactly the wheel files `build.py verify` checked.

`pip install -r packaging/macos-requirements.txt` on a Mac picks the newest wheel for that
Mac's macOS (mlx 0.32.4 ships macosx_14_0, macosx_15_0 and macosx_26_0 wheels), so a
build on macOS 15 or 26 bundles libraries that need 15.0 / 26.2, and LSMinimumSystemVersion
14.0 becomes a lie. Installing the verified files themselves, with no index, makes the
bundle's minimum macOS and its wheels agree by construction: verify has just read every
Mach-O file's minimum macOS in those same files.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from omlx_build.grammar import Installer, pip_installer
from omlx_build.project import BuildError, grammar_pins
from omlx_build.wheelset import WheelSet


def build_env_wheels(wheels: WheelSet, root: Path) -> list[Path]:
    """The verified wheel files the build environment installs: the lock and the model
    packages. The grammar packages go into the bundle only, from the same folder."""
    grammar = {canonicalize_name(name) for name in grammar_pins(root)}
    wanted = {
        name: version
        for name, version in {**wheels.lock, **wheels.pins}.items()
        if canonicalize_name(name) not in grammar
    }
    found: dict[str, list[Path]] = {canonicalize_name(name): [] for name in wanted}
    for path in sorted(wheels.wheels.glob("*.whl")):
        name, version, _build, _tags = parse_wheel_filename(path.name)
        if name in found and str(version) == wanted[name]:
            found[name].append(path)
    odd = {name: paths for name, paths in found.items() if len(paths) != 1}
    if odd:
        detail = ", ".join(f"{name}: {len(paths)} files" for name, paths in sorted(odd.items()))
        raise BuildError(
            f"the verified wheel folder {wheels.wheels} should hold one wheel per package "
            f"({detail}): delete it and run `python build.py verify` again"
        )
    return [paths[0] for paths in found.values()]


def install_command(files: Sequence[Path], python: str = sys.executable) -> list[str]:
    """pip, installing those files and nothing else: no index, no dependency resolution."""
    return [
        python, "-m", "pip", "--disable-pip-version-check", "install",
        "--no-deps", "--no-index", *(str(path) for path in files),
    ]  # fmt: skip


def install_verified(wheels: WheelSet, root: Path, extra_args: Sequence[str] = ()) -> None:
    """Install the verified set into this interpreter's environment."""
    cmd = install_command(build_env_wheels(wheels, root))
    done = subprocess.run([*cmd, *extra_args], capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"installing the verified wheels failed:\n{done.stderr.strip()[-1500:]}")
    print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "installed")


def verified_grammar_installer(wheels: WheelSet, extra_args: Sequence[str] = ()) -> Installer:
    """The bundle's grammar packages from the verified folder, never from an index."""
    return pip_installer(extra_args=["--no-index", "--find-links", str(wheels.wheels), *extra_args])
