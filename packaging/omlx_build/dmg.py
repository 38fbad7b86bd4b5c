"""The disk image: the app next to an Applications link.

`hdiutil` makes the real compressed image on macOS. On Linux `xorriso` writes the same
layout as an ISO 9660 + Rock Ridge + HFS+ hybrid, so tests can read back the app's
structure and Info.plist; that image is not verified to mount on a Mac.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omlx_build.plist import info_plist
from omlx_build.project import BuildError, BundleConfig
from omlx_build.retry import TOOL_RETRY, Retry

LAYOUT_LAUNCHER = """#!/bin/sh
echo "This omlx.app was assembled on Linux to check the disk-image layout; build the" >&2
echo "real app on a Mac: python build.py dmg (see packaging/README.md)." >&2
exit 1
"""


def skeleton_app(config: BundleConfig, parent: Path) -> Path:
    """An .app with the real Info.plist, icon and resources but a placeholder executable."""
    app = parent / f"{config.name}.app"
    contents = app / "Contents"
    resources = contents / "Resources"
    (contents / "MacOS").mkdir(parents=True)
    resources.mkdir()
    (contents / "Info.plist").write_bytes(plistlib.dumps(info_plist(config)))
    (contents / "PkgInfo").write_text("APPL????")
    launcher = contents / "MacOS" / config.name
    launcher.write_text(LAYOUT_LAUNCHER)
    launcher.chmod(0o755)
    shutil.copy2(config.icon, resources / config.icon.name)
    for item in config.resources:
        if item.is_dir():
            shutil.copytree(item, resources / item.name)
        else:
            shutil.copy2(item, resources / item.name)
    return app


def stage(app: Path, stage_dir: Path) -> Path:
    """``stage_dir`` with a copy of ``app`` and an Applications link to drag it onto."""
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    stage_dir.mkdir(parents=True)
    shutil.copytree(app, stage_dir / app.name, symlinks=True)
    (stage_dir / "Applications").symlink_to("/Applications")
    return stage_dir


def _run(cmd: list[str]) -> None:
    if shutil.which(cmd[0]) is None:
        raise BuildError(f"{cmd[0]} is not installed")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{cmd[0]} failed ({done.returncode}): {done.stderr.strip()[-800:]}")


def hdiutil_image(stage_dir: Path, out: Path, volume: str, retry: Retry = TOOL_RETRY) -> Path:
    """The compressed image; retried, as hosted runners answer "Resource busy" at times."""

    def create() -> None:
        out.unlink(missing_ok=True)  # a failed try may leave part of an image behind
        _run(["hdiutil", "create", "-volname", volume, "-srcfolder", str(stage_dir), "-ov",
              "-format", "UDZO", "-imagekey", "zlib-level=9", str(out)])  # fmt: skip

    retry.run(create, "hdiutil create")
    return out


def xorriso_image(stage_dir: Path, out: Path, volume: str) -> Path:
    out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    _run(["xorriso", "-as", "mkisofs", "-V", volume, "-R", "-hfsplus",
          "-apm-block-size", "2048", "-o", str(out), str(stage_dir)])  # fmt: skip
    return out


def extract_image(image: Path, dest: Path) -> Path:
    """Read an xorriso image back into ``dest`` (Rock Ridge keeps modes and symlinks)."""
    dest.mkdir(parents=True, exist_ok=True)
    _run(["xorriso", "-osirrox", "on", "-indev", str(image), "-extract", "/", str(dest)])
    return dest


def image_problems(volume: Path, config: BundleConfig) -> list[str]:
    """What is wrong with a mounted (or read-back) image's layout for ``config``."""
    app = volume / f"{config.name}.app"
    problems = []
    if (
        not (volume / "Applications").is_symlink()
        or os.readlink(volume / "Applications") != "/Applications"
    ):
        problems.append("the image has no Applications -> /Applications link to drag onto")
    plist_path = app / "Contents" / "Info.plist"
    if not plist_path.is_file():
        return [*problems, f"the image holds no {app.name} with an Info.plist"]
    plist = plistlib.loads(plist_path.read_bytes())
    for key, want in (("CFBundleIdentifier", config.bundle_id),
                      ("CFBundleShortVersionString", config.version)):  # fmt: skip
        if plist.get(key) != want:
            problems.append(f"{app.name} Info.plist {key} is {plist.get(key)!r}, expected {want!r}")
    launcher = app / "Contents" / "MacOS" / config.name
    if not os.access(launcher, os.X_OK):
        problems.append(f"{launcher.relative_to(volume)} is missing or not executable")
    return problems


@contextmanager
def attached(image: Path) -> Iterator[Path]:
    """The image mounted read-only (macOS's hdiutil), detached afterwards."""
    with tempfile.TemporaryDirectory(prefix="omlx-dmg-") as mount:
        _run(["hdiutil", "attach", "-nobrowse", "-readonly", "-noautoopen",
              "-mountpoint", mount, str(image)])  # fmt: skip
        try:
            yield Path(mount)
        finally:
            _run(["hdiutil", "detach", mount])
