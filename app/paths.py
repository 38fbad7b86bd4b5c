"""The one place that decides development vs frozen-bundle paths and commands."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Argument that makes the bundle's own executable act as `omlx` (see app.main).
SERVE_FLAG = "--omlx-cli"
WINDOW_FLAG = "--omlx-window"


def is_frozen() -> bool:
    """True inside a py2app bundle (py2app sets ``sys.frozen = "macosx_app"``)."""
    return bool(getattr(sys, "frozen", False))


def resources_dir() -> Path:
    """Icons and the welcome page: the bundle's Resources, or the source tree."""
    if is_frozen():
        fallback = Path(sys.executable).parent.parent / "Resources"
        return Path(os.environ.get("RESOURCEPATH", fallback))
    return REPO_ROOT / "packaging" / "icons"


def welcome_page() -> Path:
    if is_frozen():
        return resources_dir() / "welcome.html"
    return Path(__file__).resolve().parent / "resources" / "welcome.html"


def tray_icon() -> Path:
    return resources_dir() / "omlx-tray.png"


def menubar_icon() -> Path:
    return resources_dir() / "omlx-menubar-template.png"


def app_command() -> list[str]:
    """How to start the shell itself (login items, helper processes)."""
    # py2app's bootstrap exports EXECUTABLEPATH: the app's own launcher in Contents/MacOS.
    if is_frozen():
        # sys.executable is the bundle's bare interpreter (Contents/MacOS/python), not us.
        return [os.environ.get("EXECUTABLEPATH", str(Path(sys.executable).with_name("omlx")))]
    return [sys.executable, "-m", "app"]


def omlx_command(*args: str) -> list[str]:
    """`omlx ARGS...`: the module in development, the bundle's executable when frozen."""
    if is_frozen():
        return [*app_command(), SERVE_FLAG, *args]
    return [sys.executable, "-m", "omlx.cli", *args]


def window_command(*args: str) -> list[str]:
    """The admin-window child process (pywebview wants its own main thread)."""
    return [*app_command(), WINDOW_FLAG, *args]


def server_env() -> dict[str, str]:
    """Environment for `omlx serve`: in the bundle, web/ sits in Resources, not the repo."""
    env = dict(os.environ)
    if is_frozen():
        env.setdefault("OMLX_SERVER__WEB_DIR", str(resources_dir() / "web"))
    return env


def child_cwd() -> Path | None:
    return None if is_frozen() else REPO_ROOT


def default_base_path() -> Path:
    from omlx.settings import resolve_base_path

    return resolve_base_path(None)


def log_dir(base_path: Path) -> Path:
    return base_path / "logs"
