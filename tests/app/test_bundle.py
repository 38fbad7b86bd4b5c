"""The bundle after py2app (issue 23, defects 1, 3, 5, 6 and 8), proven on Linux with the
real macOS arm64 wheels (build.py verify's cached set) and py2app's real launcher.

What py2app itself does is stood in for by the layout it produces: Contents/MacOS with
its launcher and interpreter, Contents/Frameworks/Python.framework, and whole packages
in Contents/Resources/lib/python3.12. Everything omlx's build does after that runs for
real: mlx copied whole, the grammar wheels (macOS ones) installed, strip, the baked
version, the checks, and the signing plan. Only running codesign needs a Mac.
"""

from __future__ import annotations

import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packaging"))

from omlx_build.app_build import finish_bundle  # noqa: E402
from omlx_build.app_check import app_problems  # noqa: E402
from omlx_build.copy_whole import copy_whole  # noqa: E402
from omlx_build.install import verified_grammar_installer  # noqa: E402
from omlx_build.macho import parses_as_macho  # noqa: E402
from omlx_build.plist import info_plist  # noqa: E402
from omlx_build.project import BuildError, load_config  # noqa: E402
from omlx_build.signing import ENTITLEMENTS, signing_plan  # noqa: E402
from omlx_build.wheelset import pip_target_args, wheel_set  # noqa: E402

PY2APP_LAUNCHER = Path(__import__("py2app").__file__).parent / "apptemplate/prebuilt/main-arm64"


@pytest.fixture(scope="session")
def config():
    return load_config()


@pytest.fixture(scope="session")
def macos_site(config) -> Path:
    """A site-packages holding the bundle's real macOS wheels (downloaded once, cached)."""
    return wheel_set(config, ROOT).staging


def py2app_output(parent: Path, config, macos_site: Path) -> Path:
    """What py2app leaves before omlx's steps: launcher, interpreter, framework, packages."""
    app = parent / "omlx.app"
    contents = app / "Contents"
    (contents / "MacOS").mkdir(parents=True)
    (contents / "Info.plist").write_bytes(plistlib.dumps(info_plist(config)))
    shutil.copy2(PY2APP_LAUNCHER, contents / "MacOS" / "omlx")
    # Any real arm64 Mach-O stands in for the interpreter and Python.framework's binary.
    libmlx = macos_site / "mlx" / "lib" / "libmlx.dylib"
    shutil.copy2(PY2APP_LAUNCHER, contents / "MacOS" / "python")
    version = contents / "Frameworks" / "Python.framework" / "Versions" / "3.12"
    version.mkdir(parents=True)
    shutil.copy2(libmlx, version / "Python")
    (version.parent / "Current").symlink_to("3.12")
    site = contents / "Resources" / "lib" / "python3.12"
    for package in ("omlx", "numpy", "tokenizers"):
        source = (ROOT if package == "omlx" else macos_site) / package
        shutil.copytree(source, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    (site / "torch").mkdir()  # pulled in by something: the strip step must remove it
    (site / "torch" / "__init__.py").write_text("")
    return app


@pytest.fixture(scope="session")
def finished_app(tmp_path_factory, config, macos_site) -> Path:
    app = py2app_output(tmp_path_factory.mktemp("bundle"), config, macos_site)
    # The grammar wheels as `build.py app` installs them: the verified files, no index.
    verified = verified_grammar_installer(wheel_set(config, ROOT), pip_target_args(config))
    finish_bundle(app, config, search_path=[str(macos_site)], installer=verified)
    return app


def site_of(app: Path) -> Path:
    return app / "Contents" / "Resources" / "lib" / "python3.12"


def test_mlx_is_copied_whole_with_its_metadata(tmp_path, macos_site):
    target = copy_whole("mlx", tmp_path, search_path=[str(macos_site)])
    lib = target / "lib"
    assert (lib / "libmlx.dylib").is_file() and (lib / "mlx.metallib").is_file()
    assert not (target / "__init__.py").exists()  # still the namespace package it was
    assert list(target.glob("core*.so")), "the extension module that links libmlx"
    infos = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.dist-info"))
    assert infos == ["mlx", "mlx_metal"]  # importlib.metadata.version("mlx") works


def test_finished_bundle_passes_its_checks(finished_app, config):
    site = site_of(finished_app)
    assert app_problems(finished_app, config) == []
    assert not (site / "torch").exists()
    assert (site / "xgrammar" / "__init__.py").is_file()
    assert parses_as_macho(site / "xgrammar" / "libxgrammar_bindings.dylib")  # macOS wheel
    assert not list(site.rglob("*.dSYM"))  # xgrammar's debug bundle is not shipped
    # The bundle's omlx reports the baked version even with no package metadata at all
    # (-S: no site-packages, so no editable install's metadata either).
    probe = f"import sys; sys.path.insert(0, {str(site)!r}); import omlx; print(omlx.__version__)"
    done = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == config.version, done.stderr


def test_build_py_check_app_passes_the_finished_bundle(finished_app):
    done = subprocess.run(
        [sys.executable, "build.py", "check-app", str(finished_app)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "check-app: ok" in done.stdout, done.stderr


def test_check_app_names_a_moved_metallib_and_a_too_new_library(tmp_path, finished_app, config):
    app = tmp_path / "omlx.app"
    shutil.copytree(finished_app, app, symlinks=True)
    lib = site_of(app) / "mlx" / "lib"
    shutil.copy2(lib / "libmlx.dylib", app / "Contents" / "Frameworks" / "libmlx.dylib")
    (lib / "mlx.metallib").rename(app / "Contents" / "Resources" / "mlx.metallib")
    plist = info_plist(config) | {"LSMinimumSystemVersion": "13.0"}
    (app / "Contents" / "Info.plist").write_bytes(plistlib.dumps(plist))
    (site_of(app) / "omlx" / "_version.py").unlink()
    problems = "\n".join(app_problems(app, config))
    assert "Contents/Frameworks/libmlx.dylib: libmlx moved out of mlx/lib" in problems
    assert "mlx.metallib is not beside libmlx.dylib" in problems
    assert "mlx/lib/libmlx.dylib needs macOS 14.0 but LSMinimumSystemVersion is 13.0" in problems
    assert "reports version None" in problems


def test_finish_bundle_refuses_a_bundle_that_breaks_the_rules(tmp_path, config, macos_site):
    app = py2app_output(tmp_path, config, macos_site)
    # A build machine newer than the bundle's minimum: its wheels need a newer macOS.
    plist = info_plist(config) | {"LSMinimumSystemVersion": "13.0"}
    (app / "Contents" / "Info.plist").write_bytes(plistlib.dumps(plist))
    macos_pip = verified_grammar_installer(wheel_set(config, ROOT), pip_target_args(config))
    with pytest.raises(BuildError, match=r"needs macOS 14.0 but LSMinimumSystemVersion is 13.0"):
        finish_bundle(app, config, search_path=[str(macos_site)], installer=macos_pip)


def _signed_paths(plan: list[list[str]]) -> list[Path]:
    return [Path(cmd[-1]) for cmd in plan]


def test_signing_plan_signs_every_macho_inside_out(finished_app):
    plan = signing_plan(finished_app, "Developer ID Application: omlx (TEAMID)")
    signed = _signed_paths(plan)
    every_file = [p for p in finished_app.rglob("*") if p.is_file() and not p.is_symlink()]
    machos = {p for p in every_file if parses_as_macho(p)}
    assert len(machos) >= 25  # numpy, tokenizers, mlx, xgrammar, tvm_ffi, the launcher
    assert machos <= set(signed), "a Mach-O file nobody signs: notarization refuses it"
    assert signed[-1] == finished_app  # the bundle seals everything inside, so it is last
    order = {path: i for i, path in enumerate(signed)}
    for path, i in order.items():
        inside = [p for p in signed if path in p.parents]
        assert all(order[p] < i for p in inside), f"{path} is signed before what it holds"
    framework = finished_app / "Contents/Frameworks/Python.framework/Versions/3.12"
    assert framework in order and order[framework / "Python"] < order[framework]
    for cmd in plan:
        assert cmd[:5] == ["codesign", "--force", "--timestamp", "--options", "runtime"]
        program = Path(cmd[-1]).parent.name == "MacOS" or Path(cmd[-1]) == finished_app
        assert ("--entitlements" in cmd) == program, cmd  # programs only, not libraries
        if program:
            assert cmd[cmd.index("--entitlements") + 1] == str(ENTITLEMENTS)


def test_ad_hoc_plan_covers_the_same_files(finished_app):
    real = _signed_paths(signing_plan(finished_app, "Developer ID Application: x"))
    adhoc = signing_plan(finished_app, "-")
    assert _signed_paths(adhoc) == real
    assert all(cmd[:4] == ["codesign", "--force", "--sign", "-"] for cmd in adhoc)
