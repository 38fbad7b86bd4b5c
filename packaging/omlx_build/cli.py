"""Commands behind build.py."""

from __future__ import annotations

import argparse
import shutil
import sys
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
    return parser


def _check() -> int:
    problems = run_check()
    for problem in problems:
        print(f"check: {problem}", file=sys.stderr)
    if not problems:
        config = load_config()
        print(f"check: ok ({config.name} {config.version}, {config.bundle_id}, {config.arch})")
    return 1 if problems else 0


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
    try:
        if args.command == "check":
            return _check()
        if args.command == "dmg-layout":
            return _dmg_layout(args.out)
        if args.command == "grammar":
            done = install_grammar(args.target, grammar_pins(), pip_installer())
            print("installed" if done else "already installed (sentinel matches)")
            return 0
        from omlx_build.app_build import build_app

        config = load_config()
        app = build_app(config, DIST, WORK, sign=args.sign)
        if args.command == "dmg":
            image = DIST / f"{config.name}-{config.version}.dmg"
            dmg.hdiutil_image(dmg.stage(app, WORK / "dmg-stage"), image, config.name)
            print(f"wrote {image}")
        return 0
    except BuildError as exc:
        print(f"build.py: {exc}", file=sys.stderr)
        return 1
