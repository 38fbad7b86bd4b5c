"""Launch at Login: SMAppService for the macOS app, a file elsewhere.

The app bundle registers itself with `SMAppService.mainApp` (macOS 13+): the system
remembers the app, not a path, and lists it under Login Items. It refuses while the app
runs from a place it will not be found at next login (see `refusal`). Running from
source, macOS gets a LaunchAgent and Linux an XDG autostart entry.
"""

from __future__ import annotations

import os
import plistlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

LABEL = "dev.omlx.app"
MOVE_FIRST = "move omlx to Applications first"
APPROVE = "allow omlx in System Settings › General › Login Items"


class LoginItemError(Exception):
    """Launch at Login could not be changed; the message says what the user can do."""


class LoginItem(Protocol):
    def is_enabled(self) -> bool: ...

    def set_enabled(self, enabled: bool) -> None: ...


def app_bundle_of(executable: str) -> Path | None:
    """The ``.app`` folder holding ``executable`` (Contents/MacOS/omlx), if any."""
    for folder in Path(executable).parents:
        if folder.suffix == ".app":
            return folder
    return None


def refusal(bundle: Path) -> str | None:
    """Why the app at ``bundle`` must not be registered to launch at login (None: fine)."""
    where = str(bundle)
    # Gatekeeper runs a quarantined app that was not moved by Finder from a random
    # read-only copy (App Translocation); a disk image's /Volumes path is gone once it
    # is ejected. Either way the next login would not find the app.
    if "/AppTranslocation/" in where or where.startswith("/Volumes/"):
        return MOVE_FIRST
    return None


@dataclass(frozen=True, slots=True)
class AppServiceLoginItem:
    """`SMAppService.mainApp` for the running bundle (pyobjc-framework-ServiceManagement)."""

    bundle: Path
    legacy_agent: Path  # the LaunchAgent earlier versions wrote; it would start us twice

    def is_enabled(self) -> bool:
        from ServiceManagement import SMAppService, SMAppServiceStatusEnabled

        return bool(SMAppService.mainAppService().status() == SMAppServiceStatusEnabled)

    def set_enabled(self, enabled: bool) -> None:
        why = refusal(self.bundle) if enabled else None
        if why:
            raise LoginItemError(why)
        from ServiceManagement import SMAppService, SMAppServiceStatusRequiresApproval

        self.legacy_agent.unlink(missing_ok=True)
        service = SMAppService.mainAppService()
        if enabled:
            ok, error = service.registerAndReturnError_(None)
        else:
            ok, error = service.unregisterAndReturnError_(None)
        if not ok:
            detail = error.localizedDescription() if error is not None else "unknown error"
            raise LoginItemError(f"Launch at Login failed: {detail}")
        if enabled and service.status() == SMAppServiceStatusRequiresApproval:
            SMAppService.openSystemSettingsLoginItems()
            raise LoginItemError(APPROVE)


@dataclass(frozen=True, slots=True)
class LoginFile:
    """Writes or removes one file; ``command`` is what the session runs at login."""

    path: Path
    command: tuple[str, ...]
    macos: bool

    def is_enabled(self) -> bool:
        return self.path.exists()

    def set_enabled(self, enabled: bool) -> None:
        try:
            if not enabled:
                self.path.unlink(missing_ok=True)
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(self._content())
            os.replace(tmp, self.path)
        except OSError as exc:
            raise LoginItemError(f"Launch at Login: cannot write {self.path} ({exc})") from exc

    def _content(self) -> bytes:
        if self.macos:
            agent = {
                "Label": LABEL,
                "ProgramArguments": list(self.command),
                "RunAtLoad": True,
                # The shell supervises the server itself; launchd only starts it once.
                "KeepAlive": False,
                "ProcessType": "Interactive",
            }
            return plistlib.dumps(agent)
        lines = [
            "[Desktop Entry]",
            "Type=Application",
            "Name=omlx",
            "Comment=Local LLM server on MLX",
            f"Exec={' '.join(_xdg_quote(arg) for arg in self.command)}",
            "Terminal=false",
            "X-GNOME-Autostart-enabled=true",
        ]
        return ("\n".join(lines) + "\n").encode()


_XDG_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


def _xdg_quote(arg: str) -> str:
    """Desktop Entry Exec quoting: double quotes, then the string-level backslash escape."""
    if arg and not (set(arg) & _XDG_RESERVED):
        return arg
    inner = "".join("\\" + c if c in '"`$\\' else c for c in arg)
    return '"' + inner.replace("\\", "\\\\") + '"'


def login_item(
    command: list[str],
    home: Path | None = None,
    platform: str = sys.platform,
    frozen: bool = False,
) -> AppServiceLoginItem | LoginFile:
    """The login item for the shell started by ``command`` (frozen: inside omlx.app)."""
    if platform == "darwin":
        agent = (home or Path.home()) / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        bundle = app_bundle_of(command[0]) if frozen else None
        if bundle is not None:
            return AppServiceLoginItem(bundle, legacy_agent=agent)
        return LoginFile(agent, tuple(command), True)
    if home is not None:
        config = home / ".config"
    else:
        config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return LoginFile(config / "autostart" / "omlx.desktop", tuple(command), False)
