"""Commands behind build.py."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from omlx_build import dmg
from omlx_build.check import run_check
from omlx_build.grammar import install_grammar, pip_installer
from omlx_build.project import ROOT, BuildError, grammar_pins, load_config

DIST = ROOT / "dist"
WORK = ROOT / "build"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="build.py", description="Build omlx.app and its DMG")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="validate options, Info.plist, resources, version (any OS)")
    for name, text in (("app", "build dist/omlx.app (macOS)"), ("dmg", "app + .dmg (macOS)")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--sign", metavar="IDENTITY", help='e.g. "Developer ID Application: …"')
    layout = sub.add_parser("dmg-layout", help="the image's structure with xorriso (Linux)")
    layout.add_argument("--out", type=Path, help="default dist/omlx-VERSION-layout.dmg")
    grammar = sub.add_parser("grammar", help="install xgrammar + tvm-ffi into a folder")
    grammar.add_argument("--target", type=Path, required=True)
    sub.add_parser("lock", help="resolve the app's macOS package set with uv")
    sub.add_parser("verify", help="check the bundle's rules on the real macOS wheels (any OS)")
    sub.add_parser(
        "install-verified", help="verify, then install exactly the verified wheels (the Mac build)"
    )
    check_app = sub.add_parser("check-app", help="check a built omlx.app (signatures: macOS)")
    check_app.add_argument("app", type=Path)
    check_dmg = sub.add_parser("check-dmg", help="mount a DMG and check its layout (macOS)")
    check_dmg.add_argument("image", type=Path)
    pins = sub.add_parser("pins", help="print a pin for the macOS workflow")
    what = pins.add_mutually_exclusive_group(required=True)
    what.add_argument("--bundled", action="store_true", help="setup.sh's built-in model packages")
    what.add_argument("--version", action="store_true", help="the app's version")
    return parser


def _check() -> int:
    problems = run_check()
    for problem in problems:
        print(f"check: {problem}", file=sys.stderr)
    if not problems:
        config = load_config()
        print(f"check: ok ({config.name} {config.version}, {config.bundle_id}, {config.arch})")
    return 1 if problems else 0


def _lock() -> int:
    from omlx_build.wheelset import LOCK_FILE, compile_lock

    text, constrained = compile_lock(load_config(), ROOT)
    (ROOT / LOCK_FILE).write_text(text)
    count = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    note = "" if constrained else ", not constrained to this environment's versions"
    print(f"wrote {LOCK_FILE} ({count} packages{note})")
    return 0


def _verify(install: bool = False) -> int:
    from omlx_build.verify import run_verify

    started = time.monotonic()
    result = run_verify()
    print(f"the bundle's packages (macOS set in {result.wheels.staging}):")
    for name, version, size in result.sizes:
        print(f"  {size / 1e6:9.1f} MB  {name} {version}")
    total = sum(size for _name, _version, size in result.sizes)
    print(f"  {total / 1e6:9.1f} MB  total, {len(result.sizes)} packages")
    for problem in result.problems:
        print(f"verify: {problem}", file=sys.stderr)
    if result.problems:
        return 1
    print(f"verify: ok ({time.monotonic() - started:.1f} s)")
    if install:
        from omlx_build.install import install_verified

        # The files just checked, and only them: pip would pick newer-macOS wheels itself.
        install_verified(result.wheels, ROOT)
    return 0


def _report(what: str, problems: list[str]) -> int:
    for problem in problems:
        print(f"{what}: {problem}", file=sys.stderr)
    if not problems:
        print(f"{what}: ok")
    return 1 if problems else 0


def _check_app(app: Path) -> int:
    from omlx_build.app_check import app_problems
    from omlx_build.signing import unsigned_files

    problems = app_problems(app, load_config())
    if sys.platform == "darwin":
        # Each file on its own: `codesign --verify --deep` skips Contents/Resources/lib.
        problems += [f"{path.relative_to(app)} is not signed" for path in unsigned_files(app)]
    return _report("check-app", problems)


def _check_dmg(image: Path) -> int:
    with dmg.attached(image) as volume:
        return _report("check-dmg", dmg.image_problems(volume, load_config()))


def _pins(args: argparse.Namespace) -> int:
    from omlx_build.wheelset import bundled_model_pins

    print(load_config().version if args.version else " ".join(bundled_model_pins(ROOT)))
    return 0


def _build(args: argparse.Namespace) -> int:
    from omlx_build.app_build import build_app
    from omlx_build.signing import sign_image

    config = load_config()
    app = build_app(config, DIST, WORK, sign=args.sign)
    if args.command == "dmg":
        image = DIST / f"{config.name}-{config.version}.dmg"
        dmg.hdiutil_image(dmg.stage(app, WORK / "dmg-stage"), image, config.name)
        if args.sign:
            sign_image(image, args.sign)
        print(f"wrote {image}")
    return 0


def _grammar(args: argparse.Namespace) -> int:
    done = install_grammar(args.target, grammar_pins(), pip_installer())
    print("installed" if done else "already installed (sentinel matches)")
    return 0


def _dmg_layout(out: Path | None) -> int:
    config = load_config()
    built = DIST / f"{config.name}.app"
    # Scratch space next to the image: parallel runs with their own --out never collide.
    work = (out.parent / f".{out.name}.work") if out else WORK / "dmg-layout"
    # A real app from a Mac if there is one; otherwise the skeleton with the real plist.
    app = built if built.is_dir() else dmg.skeleton_app(config, _fresh(work / "skeleton"))
    stage = dmg.stage(app, work / "stage")
    image = out or DIST / f"{config.name}-{config.version}-layout.dmg"
    dmg.xorriso_image(stage, image, config.name)
    shutil.rmtree(work)
    print(f"wrote {image} (layout only: not verified to mount on a Mac)")
    return 0


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {
        "check": lambda: _check(),
        "dmg-layout": lambda: _dmg_layout(args.out),
        "lock": lambda: _lock(),
        "verify": lambda: _verify(),
        "install-verified": lambda: _verify(install=True),
        "grammar": lambda: _grammar(args),
        "check-app": lambda: _check_app(args.app),
        "check-dmg": lambda: _check_dmg(args.image),
        "pins": lambda: _pins(args),
        "app": lambda: _build(args),
        "dmg": lambda: _build(args),
    }
    try:
        return commands[args.command]()
    except BuildError as exc:
        print(f"build.py: {exc}", file=sys.stderr)
        return 1
