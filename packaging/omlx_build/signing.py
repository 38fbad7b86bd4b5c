"""Code signing for omlx.app: every Mach-O file inside out, nested bundles, then the app.

`codesign --deep` signs only code in the places Apple defines for nested code
(Contents/Frameworks, Contents/MacOS, ...), not the hundreds of `.so` / `.dylib` files
py2app leaves under Contents/Resources/lib/python3.x: notarization refuses such an app.
So every Mach-O file is found by its magic bytes and signed on its own, deepest first
(a library before whatever loads it), then each nested framework, then the bundle.

An identity of "-" signs ad hoc: what an unsigned build needs after the grammar, copy
and strip steps have changed the files py2app had already signed (Apple Silicon refuses
to run arm64 code without at least an ad-hoc signature).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from omlx_build.macho import macho_files
from omlx_build.project import ROOT, BuildError
from omlx_build.retry import TOOL_RETRY, Retry

ADHOC = "-"
ENTITLEMENTS = ROOT / "packaging" / "entitlements.plist"

Runner = Callable[[Sequence[str]], None]


def _flags(identity: str, entitlements: Path | None) -> list[str]:
    if identity == ADHOC:
        # No secure timestamp or hardened runtime for ad-hoc signatures: the timestamp
        # server wants a real identity, and the runtime buys nothing without notarization.
        return ["codesign", "--force", "--sign", ADHOC]
    flags = ["codesign", "--force", "--timestamp", "--options", "runtime"]
    if entitlements is not None:
        flags += ["--entitlements", str(entitlements)]
    return [*flags, "--sign", identity]


def nested_bundles(app: Path) -> list[Path]:
    """Framework versions and helper apps inside ``app``, deepest first."""
    contents = app / "Contents"
    found = [
        version
        for framework in contents.rglob("*.framework")
        if framework.is_dir() and not framework.is_symlink()
        for version in sorted((framework / "Versions").glob("*"))
        if version.is_dir() and not version.is_symlink()
    ]
    found += [p for p in contents.rglob("*.app") if p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: (-len(p.parts), str(p)))


def signing_plan(app: Path, identity: str, entitlements: Path = ENTITLEMENTS) -> list[list[str]]:
    """The codesign commands, in order, that sign ``app`` completely."""
    executables = app / "Contents" / "MacOS"
    plan = []
    for path in macho_files(app / "Contents"):
        # Entitlements belong to the programs that run (the launcher, the interpreter),
        # not to the libraries they load.
        ents = entitlements if path.parent == executables else None
        plan.append([*_flags(identity, ents), str(path)])
    plan += [[*_flags(identity, None), str(bundle)] for bundle in nested_bundles(app)]
    plan.append([*_flags(identity, entitlements), str(app)])
    return plan


def _run(cmd: Sequence[str]) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-600:]}")


def _sign(cmd: list[str], run: Runner, retry: Retry) -> None:
    """One codesign call; a timestamped one is retried (Apple's timestamp server may not
    answer), an ad-hoc one would only fail the same way again."""
    if "--timestamp" in cmd:
        retry.run(lambda: run(cmd), f"codesign {Path(cmd[-1]).name}")
    else:
        run(cmd)


def sign_app(
    app: Path, identity: str = ADHOC, run: Runner = _run, retry: Retry = TOOL_RETRY
) -> int:
    """Sign ``app`` inside out and verify it; the number of codesign calls made."""
    if shutil.which("codesign") is None and run is _run:
        raise BuildError("codesign is not installed (signing needs macOS and Xcode's tools)")
    plan = signing_plan(app, identity)
    for cmd in plan:
        _sign(cmd, run, retry)
    run(["codesign", "--verify", "--deep", "--strict", str(app)])
    return len(plan)


def sign_image(image: Path, identity: str, run: Runner = _run, retry: Retry = TOOL_RETRY) -> None:
    """Sign the DMG itself (notarization wants the container signed too)."""
    _sign(["codesign", "--force", "--timestamp", "--sign", identity, str(image)], run, retry)
    run(["codesign", "--verify", "--strict", str(image)])


def unsigned_files(app: Path, run: Runner = _run) -> list[Path]:
    """Mach-O files in ``app`` that do not carry a valid signature (macOS only)."""
    bad = []
    for path in macho_files(app / "Contents"):
        try:
            run(["codesign", "--verify", "--strict", str(path)])
        except BuildError:
            bad.append(path)
    return bad
