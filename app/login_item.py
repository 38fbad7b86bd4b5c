"""Launch at Login: a LaunchAgent on macOS, an XDG autostart entry on Linux."""

from __future__ import annotations

import os
import plistlib
import sys
from dataclasses import dataclass
from pathlib import Path

LABEL = "dev.omlx.app"


@dataclass(frozen=True, slots=True)
class LoginItem:
    """Writes or removes one file; ``command`` is what the session runs at login."""

    path: Path
    command: tuple[str, ...]
    macos: bool

    def is_enabled(self) -> bool:
        return self.path.exists()

    def set_enabled(self, enabled: bool) -> None:
        if not enabled:
            self.path.unlink(missing_ok=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(self._content())
        os.replace(tmp, self.path)

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
    command: list[str], home: Path | None = None, platform: str = sys.platform
) -> LoginItem:
    if platform == "darwin":
        home = home or Path.home()
        return LoginItem(home / "Library" / "LaunchAgents" / f"{LABEL}.plist", tuple(command), True)
    if home is not None:
        config = home / ".config"
    else:
        config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return LoginItem(config / "autostart" / "omlx.desktop", tuple(command), False)
