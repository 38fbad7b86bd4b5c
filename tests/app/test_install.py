"""`build.py install-verified` and the bundle's grammar install: the Mac build takes the very
wheel files `build.py verify` checked, whatever macOS the build machine runs.

pip is the real one; a macOS build machine is what pip sees with `--platform
macosx_15_0_arm64 --target` (these macOS wheels cannot be installed into this Linux
environment), with `--dry-run --report` where installing is not the point.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packaging"))

from omlx_build.grammar import install_grammar  # noqa: E402
from omlx_build.install import (  # noqa: E402
    build_env_wheels,
    install_command,
    verified_grammar_installer,
)
from omlx_build.project import BuildError, grammar_pins, load_config  # noqa: E402
from omlx_build.wheelset import WheelSet, pip_target_args, wheel_set  # noqa: E402


@pytest.fixture(scope="module")
def config():
    return load_config(ROOT)


@pytest.fixture(scope="module")
def wheels(config) -> WheelSet:
    return wheel_set(config, ROOT)


@pytest.fixture(scope="module")
def on_macos_15(config) -> list[str]:
    """pip's options that make it choose wheels as it would on a macOS 15 build machine."""
    return pip_target_args(replace(config, minimum_macos="15.0"))


def _pip_report(args: list[str], tmp_path: Path) -> dict[str, str]:
    """name -> the file pip would install, from a real `pip install --dry-run --report`."""
    tmp_path.mkdir()
    report = tmp_path / "report.json"
    cmd = [*args, "--dry-run", "--quiet", "--report", str(report), "--target", str(tmp_path)]
    done = subprocess.run(cmd, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    items = json.loads(report.read_text())["install"]
    return {
        canonicalize_name(item["metadata"]["name"]): item["download_info"]["url"].rsplit("/", 1)[-1]
        for item in items
    }


def test_the_build_installs_the_verified_files_where_pip_would_pick_macos_15_wheels(
    config, wheels, on_macos_15, tmp_path
):
    files = build_env_wheels(wheels, ROOT)
    grammar = {canonicalize_name(name) for name in grammar_pins(ROOT)}
    expected = {**wheels.lock, **{n: v for n, v in wheels.pins.items() if n not in grammar}}
    assert {
        parse_wheel_filename(f.name)[0]: str(parse_wheel_filename(f.name)[1]) for f in files
    } == {canonicalize_name(name): version for name, version in expected.items()}
    assert all(f.parent == wheels.wheels for f in files)
    chosen = _pip_report(install_command(files) + on_macos_15, tmp_path / "verified")
    assert set(chosen.values()) == {f.name for f in files}
    assert chosen["mlx"] == f"mlx-{wheels.lock['mlx']}-cp312-cp312-macosx_14_0_arm64.whl"
    # The defect this prevents: pip left to choose takes the macOS 15 build of mlx.
    from_index = [sys.executable, "-m", "pip", "install", "--no-deps", *on_macos_15]
    picked = _pip_report([*from_index, f"mlx=={wheels.lock['mlx']}"], tmp_path / "index")
    assert "macosx_15_0" in picked["mlx"]


def test_the_bundles_grammar_packages_are_the_verified_files(wheels, on_macos_15, tmp_path):
    site = tmp_path / "site-packages"
    installer = verified_grammar_installer(wheels, on_macos_15)
    assert install_grammar(site, grammar_pins(ROOT), installer) is True
    (library,) = (wheels.staging / "xgrammar").glob("libxgrammar_bindings.dylib")
    installed = site / library.relative_to(wheels.staging)
    assert installed.read_bytes() == library.read_bytes()
    # A version the verified folder lacks is an error, never a download from the index.
    with pytest.raises(subprocess.CalledProcessError):
        install_grammar(tmp_path / "other", {**grammar_pins(ROOT), "xgrammar": "0.1.0"}, installer)


def test_a_verified_folder_with_two_wheels_of_one_package_is_refused(wheels, tmp_path):
    folder = tmp_path / "wheels"
    shutil.copytree(wheels.wheels, folder, copy_function=os.link)
    (numpy,) = folder.glob("numpy-*.whl")
    os.link(numpy, folder / numpy.name.replace("macosx_14_0", "macosx_15_0"))
    with pytest.raises(BuildError, match=r"one wheel per package \(numpy: 2 files\)"):
        build_env_wheels(replace(wheels, wheels=folder), ROOT)
