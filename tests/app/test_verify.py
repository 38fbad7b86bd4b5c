"""`build.py verify` on the real macOS wheels of the bundle, and the Mach-O helpers.

The locked set is downloaded once into the wheel cache (OMLX_MACOS_WHEELS or
~/.cache/omlx/macos-wheels) and reused; every check here reads those real files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packaging"))

from omlx_build import macho  # noqa: E402
from omlx_build.project import BundleConfig, grammar_pins, load_config  # noqa: E402
from omlx_build.verify import (  # noqa: E402
    copy_problems,
    forbidden_problems,
    grammar_problems,
    include_problems,
    minos_problems,
    package_problems,
    requirement_problems,
    run_verify,
    signing_problems,
    workflow_problems,
)
from omlx_build.wheelset import (  # noqa: E402
    WheelSet,
    cache_root,
    pip_target_args,
    wheel_set,
)


@pytest.fixture(scope="session")
def config() -> BundleConfig:
    return load_config(ROOT)


@pytest.fixture(scope="session")
def wheels(config: BundleConfig) -> WheelSet:
    return wheel_set(config, ROOT)


def _link_tree(src: Path, dst: Path) -> None:
    """A cheap copy of a cached tree: hard links, so tests may move or delete entries in
    it but must never write into its files (they are the cache's files)."""
    shutil.copytree(src, dst, copy_function=os.link, symlinks=True)


def test_verify_passes_on_the_real_bundle_config():
    done = subprocess.run(
        [sys.executable, "build.py", "verify"], cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "verify: ok" in done.stdout
    # The package list with sizes, largest first, and the total.
    lines = [line for line in done.stdout.splitlines() if " MB  " in line]
    sizes = [float(line.split()[0]) for line in lines[:-1]]
    assert sizes == sorted(sizes, reverse=True)
    assert any(line.split()[2:] == ["mlx-metal", "0.32.4"] for line in lines)
    assert "total" in lines[-1]


def test_mlx_back_in_py2app_packages_is_reported(config, wheels):
    assert package_problems(config, ROOT, wheels.staging) == []
    with_mlx = replace(config, py2app_packages=(*config.py2app_packages, "mlx"))
    problems = run_verify(ROOT, with_mlx).problems
    assert len(problems) == 1, problems
    assert "py2app cannot find bundle.toml [py2app] package 'mlx'" in problems[0]
    assert "[copy] packages" in problems[0]


def test_an_include_missing_from_the_macos_set_is_reported(config, wheels):
    assert include_problems(config, wheels.staging) == []  # PyObjCTools is a namespace pkg
    missing = replace(config, py2app_includes=(*config.py2app_includes, "PyObjCTools.Nope"))
    assert include_problems(missing, wheels.staging) == [
        "bundle.toml [py2app] includes 'PyObjCTools.Nope', which the macOS set does not "
        "have: add its distribution to pyproject's app extra and run `python build.py lock`"
    ]


def test_metallib_separated_from_libmlx_is_reported(config, wheels, tmp_path):
    staging = tmp_path / "site-packages"
    _link_tree(wheels.staging / "mlx", staging / "mlx")
    assert copy_problems(config, staging) == []
    (staging / "mlx" / "lib" / "mlx.metallib").rename(staging / "mlx" / "mlx.metallib")
    problems = copy_problems(config, staging)
    assert problems == [
        "mlx.metallib is not beside mlx/lib/libmlx.dylib: MLX would fail with "
        "'Failed to load the default metallib'"
    ]


def test_mlx_outside_copy_packages_is_reported(config, wheels):
    problems = copy_problems(replace(config, copy_packages=()), wheels.staging)
    assert any("mlx/lib/libmlx.dylib is outside bundle.toml [copy]" in p for p in problems)


def _macos15_libmlx(config: BundleConfig, version: str, dest: Path) -> Path:
    """libmlx.dylib from the real mlx-metal wheel built for macOS 15 (cached download)."""
    folder = cache_root() / "test-macosx15"  # not a set's key: kept
    args = pip_target_args(replace(config, minimum_macos="15.0"))
    if not list(folder.glob("mlx_metal-*.whl")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *args,
             "-d", str(folder), f"mlx-metal=={version}"],
            check=True, timeout=300,
        )  # fmt: skip
    (wheel,) = folder.glob("mlx_metal-*macosx_15_0_arm64.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract("mlx/lib/libmlx.dylib", dest)
    return dest / "mlx" / "lib" / "libmlx.dylib"


def test_a_wheel_built_for_macos_15_is_reported(config, wheels, tmp_path):
    assert minos_problems(config, wheels.staging) == []
    library = _macos15_libmlx(config, wheels.lock["mlx-metal"], tmp_path)
    assert macho.min_macos(library) == "15.0"
    problems = minos_problems(config, tmp_path)
    assert len(problems) == 1
    assert "mlx/lib/libmlx.dylib (minos 15.0)" in problems[0]
    assert f"minimum_macos {config.minimum_macos}" in problems[0]


def test_torch_in_the_set_is_reported(config, wheels, tmp_path):
    assert forbidden_problems(config, wheels.staging) == []
    info = tmp_path / "torch-2.5.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (problem,) = forbidden_problems(config, tmp_path)
    assert "contains torch 2.5.1, torch/" in problem


def test_grammar_packages_at_other_versions_than_setup_sh_are_reported(wheels, tmp_path):
    assert grammar_problems(ROOT, wheels.staging) == []
    pinned = grammar_pins(ROOT)["xgrammar"]
    setup_sh = (ROOT / "setup.sh").read_text().replace(f'"xgrammar=={pinned}"', '"xgrammar==9.9"')
    (tmp_path / "setup.sh").write_text(setup_sh)
    assert grammar_problems(tmp_path, wheels.staging) == [
        f"xgrammar in the macOS set is {pinned}, setup.sh's GRAMMAR_PKGS pins 9.9"
    ]


def test_requirement_missing_from_the_lock_is_reported(config, wheels):
    assert requirement_problems(config, ROOT, wheels) == []
    lock = dict(wheels.lock)
    del lock["pyobjc-framework-servicemanagement"]
    lock["mlx"] = "0.31.0"
    problems = requirement_problems(config, ROOT, replace(wheels, lock=lock))
    assert problems == [
        "packaging/macos-requirements.txt has mlx 0.31.0; pyproject.toml requires "
        "\"mlx==0.32.4; sys_platform == 'darwin'\" on macOS: run `python build.py lock`",
        "packaging/macos-requirements.txt has no pyobjc-framework-ServiceManagement; "
        'pyproject.toml requires "pyobjc-framework-ServiceManagement>=10; sys_platform == '
        "'darwin'\" on macOS: run `python build.py lock`",
    ]


def test_a_lock_mixing_pyobjc_releases_is_reported(config, wheels):
    # PyObjC's wrappers are built against their own pyobjc-core release.
    lock = {**wheels.lock, "pyobjc-core": "13.0"}
    problems = requirement_problems(config, ROOT, replace(wheels, lock=lock))
    assert len(problems) == 1
    assert problems[0].startswith("packaging/macos-requirements.txt mixes pyobjc releases (")
    assert "pyobjc-core==13.0" in problems[0] and "pyobjc-framework-cocoa==12.2.2" in problems[0]


def test_workflow_without_the_build_pins_is_reported(config, tmp_path):
    workflow = tmp_path / ".github" / "workflows" / "macos-dmg.yml"
    workflow.parent.mkdir(parents=True)
    workflow.write_text(
        'python-version: "3.13"\npip install "py2app>=0.28" setuptools\n'
        "pip install -r packaging/macos-requirements.txt\n"
    )
    problems = workflow_problems(config, tmp_path)
    assert problems == [
        *(
            f".github/workflows/macos-dmg.yml should contain {item!r} (bundle.toml [build], "
            "the verified set)"
            for item in (
                "py2app==0.28.10",
                "setuptools==70.3.0",
                'python-version: "3.12"',
                "build.py install-verified",
            )
        ),
        ".github/workflows/macos-dmg.yml installs packaging/macos-requirements.txt with pip, "
        "which picks wheels for the runner's macOS (newer than 14.0): use "
        "`python build.py install-verified`",
    ]
    assert workflow_problems(config, ROOT) == []


def test_macho_hidden_without_a_library_suffix_is_in_the_signing_list(wheels, tmp_path):
    source = next(wheels.staging.glob("numpy/_core/_multiarray_umath*.so"))
    helper = tmp_path / "pkg" / "bin" / "helper"
    helper.parent.mkdir(parents=True)
    shutil.copyfile(source, helper)
    (tmp_path / "pkg" / "link").symlink_to(helper)  # links are not signed twice
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    assert macho.macho_files(tmp_path) == [helper]
    assert signing_problems(tmp_path) == []


def test_a_library_name_that_is_not_macho_is_reported(tmp_path):
    (tmp_path / "_speedups.so").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64))
    (problem,) = signing_problems(tmp_path)
    assert "1 compiled file(s) would ship unsigned" in problem
    assert "_speedups.so" in problem


def test_signing_order_is_inside_out_over_the_real_set(wheels):
    files = macho.macho_files(wheels.staging)
    depths = [len(p.parts) for p in files]
    assert depths == sorted(depths, reverse=True)
    names = {str(p.relative_to(wheels.staging)) for p in files}
    assert {"mlx/lib/libmlx.dylib", "mlx/core.cpython-312-darwin.so"} <= names
    assert not any(name.endswith((".py", ".metallib")) for name in names)


def test_min_macos_reads_the_arm64_slice_of_a_universal_binary(wheels):
    # pyobjc-core is universal2: its x86_64 slice says 10.13, its arm64 slice 11.0.
    (objc,) = wheels.staging.glob("objc/_objc.cpython-312-darwin.so")
    assert macho.min_macos(objc) == "11.0"
    assert macho.min_macos(wheels.staging / "mlx" / "lib" / "libmlx.dylib") == "14.0"


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (bytes.fromhex("cffaedfe0c000001"), True),  # arm64, 64-bit little-endian
        (bytes.fromhex("feedfacf0100000c"), True),  # 64-bit big-endian
        (bytes.fromhex("cefaedfe07000000"), True),  # 32-bit little-endian
        (bytes.fromhex("feedface00000007"), True),  # 32-bit big-endian
        (bytes.fromhex("cafebabe00000002"), True),  # universal, two slices
        (bytes.fromhex("cafebabf00000001"), True),  # universal 64-bit offsets, one slice
        (bytes.fromhex("cafebabe00000034"), False),  # Java class file, version 52
        (bytes.fromhex("cafebabe00000000"), False),  # no slices
        (b"\x7fELF\x02\x01\x01\x00", False),
        (bytes.fromhex("cffaedfe"), False),  # truncated
        (b"", False),
    ],
)
def test_is_macho_by_magic_bytes(tmp_path, head, expected):
    path = tmp_path / "file"
    path.write_bytes(head + bytes(24) if len(head) == 8 else head)
    assert macho.is_macho(path) is expected
