"""The one place that decides development vs frozen-bundle paths and commands."""

from __future__ import annotations

import os
import plistlib
import subprocess
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


def app_bundle() -> Path | None:
    """The running omlx.app (None from source): what an update replaces."""
    if not is_frozen():
        return None
    from app.login_item import app_bundle_of

    return app_bundle_of(app_command()[0])


def update_feed_of(bundle: Path | None) -> str:
    """The release feed ``bundle`` was built with (Info.plist OMLXUpdateFeed: the
    project's releases); "" from source or a build without one (no update checks)."""
    info = _info_plist(bundle) if bundle is not None else {}
    feed = info.get("OMLXUpdateFeed", "")
    return feed if isinstance(feed, str) else ""


def _info_plist(bundle: Path) -> dict[str, object]:
    try:
        info = plistlib.loads((bundle / "Contents" / "Info.plist").read_bytes())
    except (OSError, plistlib.InvalidFileException):
        return {}
    return info if isinstance(info, dict) else {}


def build_id() -> str:
    """The bundle's CFBundleVersion; from source, the git commit (or "dev")."""
    bundle = app_bundle()
    if bundle is not None:
        return str(_info_plist(bundle).get("CFBundleVersion", "unknown"))
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=5,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "dev"
    commit = done.stdout.strip()
    return f"dev {commit}" if done.returncode == 0 and commit else "dev"


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
