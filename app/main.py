"""`omlx-app` / `python -m app`: the desktop shell's entry point."""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import sys
from pathlib import Path

from app import paths

log = logging.getLogger("omlx.app")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omlx-app", description="omlx menu-bar app")
    parser.add_argument("--base-path", type=Path, help="data folder (default ~/.omlx)")
    parser.add_argument("--port", type=int, help="server port (default: settings.json)")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `omlx serve` argument (repeatable), e.g. --serve-arg=--model-dir=DIR",
    )
    parser.add_argument("--no-autostart", action="store_true", help="do not start the server")
    parser.add_argument("--no-welcome", action="store_true", help="skip the first-run page")
    return parser


def setup_logging(base_path: Path) -> Path:
    log_dir = paths.log_dir(base_path)
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(
        log_dir / "app.log", maxBytes=5_000_000, backupCount=3, encoding="utf-8"
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    root.addHandler(logging.StreamHandler(sys.stderr))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    return log_dir


def run_shell(argv: list[str]) -> int:
    from app.controller import AppConfig, Controller

    args = _parser().parse_args(argv)
    base = (args.base_path or paths.default_base_path()).expanduser()
    log_dir = setup_logging(base)
    overrides: dict[str, object] = {"extra_args": tuple(args.serve_arg)}
    if args.port is not None:
        overrides["port"] = args.port
    controller = Controller(AppConfig.from_settings(base, **overrides))
    log.info("omlx app: data in %s, logs in %s", base, log_dir)
    if sys.platform == "darwin":
        from app.macos import run_menu_bar

        runner = run_menu_bar
    else:
        from app.tray import run_tray

        runner = run_tray
    return runner(controller, autostart=not args.no_autostart, welcome=not args.no_welcome)


def main(argv: list[str] | None = None) -> int:
    from omlx.private_fs import restrict_umask

    # Before any file is written; the server and window children inherit it.
    restrict_umask()
    argv = sys.argv[1:] if argv is None else argv
    # The frozen bundle has one executable; these flags make it the CLI or the window.
    if argv[:1] == [paths.SERVE_FLAG]:
        from omlx.cli import main as omlx_main

        return omlx_main(argv[1:])
    if argv[:1] == [paths.WINDOW_FLAG]:
        from app.webview_main import run

        return run(argv[1:])
    try:
        return run_shell(argv)
    except Exception:
        # Into app.log too: py2app's alert says "see the Console", which has no traceback.
        log.exception("omlx could not start")
        raise
