"""The few calls the updater and the menu make that only macOS has, in one place.

`MacCalls` runs Apple's tools: `hdiutil` (mount a disk image), `ditto` (copy an app with
its extended attributes), `codesign` / `stapler` (who signed an app, is it notarized),
`open` (start an app, show a folder). `LinuxCalls` is what Linux offers in their place:
the disk image is an xorriso ISO/HFS+ hybrid (what `build.py dmg-layout` writes), read
back with `xorriso -osirrox` instead of mounted; an app is started by its launcher; a
folder is shown with `xdg-open`. Linux has no code signing, so every app there counts as
ad hoc and an update must match its published SHA-256. The tests drive the updater's
Mac code paths through `LinuxCalls`; only this module differs.
"""

from __future__ import annotations

import logging
import os
import platform
import plistlib
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger("omlx.app")

TOOL_TIMEOUT_S = 120.0


class PlatformCallError(Exception):
    """A system tool failed; the message names it and what it said."""


@dataclass(frozen=True, slots=True)
class Signature:
    """Who signed an app: ``team_id`` None means ad hoc (or unsigned)."""

    valid: bool  # the signature covers every file as it is now
    team_id: str | None
    notarized: bool  # a notarization ticket is stapled to it


class PlatformCalls(Protocol):
    def attach(self, image: Path) -> AbstractContextManager[Path]: ...

    def copy_app(self, source: Path, dest: Path) -> None: ...

    def signature(self, app: Path) -> Signature: ...

    def relaunch(self, app: Path) -> None: ...

    def reveal(self, folder: Path) -> None: ...

    def macos_version(self) -> str | None: ...


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    if shutil.which(cmd[0]) is None:
        raise PlatformCallError(f"{cmd[0]} is not installed")
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PlatformCallError(f"{cmd[0]} took over {TOOL_TIMEOUT_S:g} s") from None


def _check(cmd: list[str]) -> str:
    done = _run(cmd)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()[-400:]
        raise PlatformCallError(f"{cmd[0]} failed ({done.returncode}): {said}")
    return done.stdout


def team_identifier(codesign_details: str) -> str | None:
    """The TeamIdentifier line of `codesign -dv` output ("not set" for ad hoc: None)."""
    for line in codesign_details.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "TeamIdentifier":
            value = value.strip()
            return None if value in ("", "not set") else value
    return None


def _start_detached(cmd: list[str]) -> None:
    subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives the app that is about to quit
    )


class MacCalls:
    @contextmanager
    def attach(self, image: Path) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="omlx-update-") as mount:
            _check(["hdiutil", "attach", "-nobrowse", "-readonly", "-noautoopen",
                    "-mountpoint", mount, str(image)])  # fmt: skip
            try:
                yield Path(mount)
            finally:
                if _run(["hdiutil", "detach", mount]).returncode != 0:
                    _run(["hdiutil", "detach", "-force", mount])

    def copy_app(self, source: Path, dest: Path) -> None:
        _check(["ditto", str(source), str(dest)])  # keeps signatures kept in xattrs

    def signature(self, app: Path) -> Signature:
        valid = _run(["codesign", "--verify", "--deep", "--strict", str(app)]).returncode == 0
        details = _run(["codesign", "-dv", "--verbose=2", str(app)])
        stapled = _run(["xcrun", "stapler", "validate", str(app)]).returncode == 0
        return Signature(valid, team_identifier(details.stderr), stapled)

    def relaunch(self, app: Path) -> None:
        _check(["open", "-n", str(app)])

    def reveal(self, folder: Path) -> None:
        _check(["open", str(folder)])

    def macos_version(self) -> str | None:
        return platform.mac_ver()[0] or None


class LinuxCalls:
    @contextmanager
    def attach(self, image: Path) -> Iterator[Path]:
        mount = Path(tempfile.mkdtemp(prefix="omlx-update-"))
        try:
            _check(["xorriso", "-osirrox", "on", "-indev", str(image), "-extract", "/",
                    str(mount)])  # fmt: skip
            yield mount
        finally:
            remove_tree(mount)

    def copy_app(self, source: Path, dest: Path) -> None:
        shutil.copytree(source, dest, symlinks=True)

    def signature(self, app: Path) -> Signature:
        return Signature(valid=True, team_id=None, notarized=False)

    def relaunch(self, app: Path) -> None:
        _start_detached([str(bundle_executable(app))])

    def reveal(self, folder: Path) -> None:
        _check(["xdg-open", str(folder)])

    def macos_version(self) -> str | None:
        return None  # not a Mac: an app's minimum macOS does not apply


def bundle_executable(app: Path) -> Path:
    """The launcher Info.plist names (Contents/MacOS/<CFBundleExecutable>)."""
    contents = app / "Contents"
    plist = plistlib.loads((contents / "Info.plist").read_bytes())
    return contents / "MacOS" / str(plist.get("CFBundleExecutable", app.stem))


def remove_tree(path: Path) -> None:
    """Delete ``path``, also where a read-only image left folders without write access."""
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    if not path.exists():
        return
    for folder, _dirs, _files in os.walk(path):
        os.chmod(folder, stat.S_IRWXU)
    shutil.rmtree(path)


def platform_calls() -> PlatformCalls:
    return MacCalls() if sys.platform == "darwin" else LinuxCalls()
