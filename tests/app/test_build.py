"""build.py and packaging/: check, Info.plist, the grammar sentinel, strip, the disk image."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packaging"))

from omlx_build import dmg  # noqa: E402
from omlx_build.app_build import py2app_options  # noqa: E402
from omlx_build.check import run_check  # noqa: E402
from omlx_build.grammar import SENTINEL, install_grammar, is_installed  # noqa: E402
from omlx_build.plist import info_plist, plist_problems  # noqa: E402
from omlx_build.project import BuildError, grammar_pins, load_config, project_version  # noqa: E402
from omlx_build.strip import strip_packages  # noqa: E402

PINS = {"xgrammar": "0.2.8", "apache-tvm-ffi": "0.1.15"}


def _build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "build.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_check_passes_on_this_tree():
    done = _build("check")
    assert done.returncode == 0, done.stderr
    assert f"check: ok (omlx {project_version()}, dev.omlx.app, arm64)" in done.stdout


def test_app_build_refuses_off_macos_with_a_clear_message():
    if sys.platform == "darwin":
        pytest.skip("builds for real on macOS")
    done = _build("app")
    assert done.returncode == 1
    assert "py2app builds omlx.app on macOS only" in done.stderr


def test_info_plist_keys():
    config = load_config()
    plist = plistlib.loads(plistlib.dumps(info_plist(config)))  # survives the file format
    assert plist["CFBundleIdentifier"] == "dev.omlx.app"
    assert plist["CFBundleShortVersionString"] == project_version()
    assert plist["LSUIElement"] is True  # menu bar only, no Dock icon
    assert plist["LSMinimumSystemVersion"] == "14.0"
    assert plist["LSArchitecturePriority"] == ["arm64"]
    assert plist["CFBundleIconFile"] == "omlx.icns"
    assert plist["NSAppTransportSecurity"] == {"NSAllowsLocalNetworking": True}
    assert plist_problems(plist, config) == []


def test_plist_problems_name_what_is_wrong():
    config = load_config()
    plist = info_plist(config)
    plist["LSUIElement"] = False
    plist["CFBundleShortVersionString"] = "0.0.1-dev"
    del plist["LSMinimumSystemVersion"]
    problems = plist_problems(plist, config)
    assert "Info.plist lacks LSMinimumSystemVersion" in problems
    assert "Info.plist LSUIElement is False, expected True" in problems
    assert any("must be up to three integers" in p for p in problems)


def test_py2app_options_exclude_torch_and_ship_resources():
    config = load_config()
    options = py2app_options(config)
    assert {"torch", "triton"} <= set(options["excludes"])
    assert {"omlx", "app"} <= set(options["packages"])
    assert options["arch"] == "arm64" and options["plist"]["LSUIElement"] is True
    assert all(Path(r).exists() for r in options["resources"])
    assert grammar_pins() == PINS  # read from setup.sh's GRAMMAR_PKGS


# -- the grammar step's sentinel --------------------------------------------------------


class PipLikeInstaller:
    """Writes package files into the target as `pip install --target` would, and can
    stop half-way or leave a file empty to play an interrupted or truncated install."""

    def __init__(self, fail_after: str | None = None, empty: str | None = None):
        self.fail_after, self.empty = fail_after, empty
        self.calls: list[list[str]] = []

    def __call__(self, target: Path, requirements: Sequence[str]) -> None:
        self.calls.append(list(requirements))
        for req in requirements:
            name, version = req.split("==")
            module = "tvm_ffi" if name == "apache-tvm-ffi" else name
            (target / module).mkdir(parents=True, exist_ok=True)
            text = "" if self.empty == name else f"__version__ = {version!r}\n"
            (target / module / "__init__.py").write_text(text)
            dist = target / f"{name.replace('-', '_')}-{version}.dist-info"
            dist.mkdir(exist_ok=True)
            if self.fail_after == name:
                raise KeyboardInterrupt("install interrupted")


def test_install_writes_a_versioned_sentinel_and_is_idempotent(tmp_path):
    site = tmp_path / "site-packages"
    installer = PipLikeInstaller()
    assert install_grammar(site, PINS, installer) is True
    sentinel = json.loads((site / SENTINEL).read_text())
    assert sentinel == {"format": 1, "packages": dict(sorted(PINS.items()))}
    assert not list(site.glob("*.tmp"))  # written through a temp file + rename
    assert install_grammar(site, PINS, installer) is False
    assert len(installer.calls) == 1


def test_interrupted_install_is_not_taken_as_done(tmp_path):
    site = tmp_path / "site-packages"
    with pytest.raises(KeyboardInterrupt):
        install_grammar(site, PINS, PipLikeInstaller(fail_after="apache-tvm-ffi"))
    assert not (site / SENTINEL).exists()
    assert not is_installed(site, PINS)
    retry = PipLikeInstaller()
    assert install_grammar(site, PINS, retry) is True and retry.calls
    assert is_installed(site, PINS)


def test_truncated_package_fails_and_leaves_no_sentinel(tmp_path):
    site = tmp_path / "site-packages"
    with pytest.raises(BuildError, match=r"tvm_ffi/__init__.py is empty"):
        install_grammar(site, PINS, PipLikeInstaller(empty="apache-tvm-ffi"))
    assert not (site / SENTINEL).exists()


def test_truncation_after_install_invalidates_the_sentinel(tmp_path):
    site = tmp_path / "site-packages"
    install_grammar(site, PINS, PipLikeInstaller())
    (site / "xgrammar" / "__init__.py").write_text("")
    assert not is_installed(site, PINS)
    again = PipLikeInstaller()
    assert install_grammar(site, PINS, again) is True and again.calls


def test_version_change_reinstalls_and_an_interruption_drops_the_old_sentinel(tmp_path):
    site = tmp_path / "site-packages"
    install_grammar(site, PINS, PipLikeInstaller())
    newer = {**PINS, "xgrammar": "0.2.9"}
    assert not is_installed(site, newer)
    with pytest.raises(KeyboardInterrupt):
        install_grammar(site, newer, PipLikeInstaller(fail_after="xgrammar"))
    # The old sentinel no longer vouches for a folder now half-way to another version.
    assert not (site / SENTINEL).exists() and not is_installed(site, PINS)
    upgrade = PipLikeInstaller()
    assert install_grammar(site, newer, upgrade) is True
    assert upgrade.calls == [["apache-tvm-ffi==0.1.15", "xgrammar==0.2.9"]]
    assert is_installed(site, newer)


def test_strip_removes_torch_and_friends_only(tmp_path):
    site = tmp_path / "site-packages"
    for name in ("torch", "torch-2.5.1.dist-info", "triton", "torchgen", "numpy", "xgrammar"):
        (site / name).mkdir(parents=True)
    (site / "functorch.py").write_text("")
    removed = strip_packages(site, load_config().strip)
    assert sorted(removed) == [
        "functorch.py", "torch", "torch-2.5.1.dist-info", "torchgen", "triton"
    ]  # fmt: skip
    assert sorted(p.name for p in site.iterdir()) == ["numpy", "xgrammar"]


# -- the disk image ---------------------------------------------------------------------


def test_dmg_layout_image_reads_back(tmp_path):
    if not shutil.which("xorriso"):
        pytest.skip("xorriso is not installed (apt-get install xorriso)")
    image = tmp_path / "omlx-layout.dmg"
    done = _build("dmg-layout", "--out", str(image))
    assert done.returncode == 0, done.stderr
    out = dmg.extract_image(image, tmp_path / "read-back")
    app = out / "omlx.app" / "Contents"
    plist = plistlib.loads((app / "Info.plist").read_bytes())
    assert plist["CFBundleIdentifier"] == "dev.omlx.app"
    assert plist["CFBundleShortVersionString"] == project_version()
    assert plist["LSUIElement"] is True
    assert os.readlink(out / "Applications") == "/Applications"
    assert os.access(app / "MacOS" / "omlx", os.X_OK)
    assert (app / "Resources" / "omlx.icns").read_bytes()[:4] == b"icns"
    assert (app / "Resources" / "welcome.html").is_file()
    assert (app / "Resources" / "web" / "index.html").is_file()
    assert (app / "PkgInfo").read_text() == "APPL????"
    # The same check the macOS job runs on the mounted DMG (build.py check-dmg).
    assert dmg.image_problems(out, load_config()) == []
    (out / "Applications").unlink()
    (app / "MacOS" / "omlx").chmod(0o644)
    assert dmg.image_problems(out, load_config()) == [
        "the image has no Applications -> /Applications link to drag onto",
        "omlx.app/Contents/MacOS/omlx is missing or not executable",
    ]


def test_check_reports_a_missing_icon_and_a_server_that_imports_the_shell(tmp_path):
    for folder in ("packaging", "app/resources", ".github", "web"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    for name in ("pyproject.toml", "setup.sh"):
        shutil.copy2(ROOT / name, tmp_path / name)
    assert run_check(tmp_path) == []  # the copy is as good as the tree
    (tmp_path / "omlx").mkdir()
    (tmp_path / "omlx" / "bad.py").write_text("from app import paths\n")
    (tmp_path / "packaging" / "icons" / "omlx.icns").unlink()
    problems = run_check(tmp_path)
    assert f"icon {tmp_path}/packaging/icons/omlx.icns is missing" in problems
    assert "omlx/bad.py imports app/ (the server must not depend on the shell)" in problems
