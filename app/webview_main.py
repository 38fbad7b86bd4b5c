"""The admin-window process: a pywebview window driven by lines on stdin.

stdin: ``focus`` | ``navigate URL`` | ``server [URL]`` (where the shell's server is now; the
welcome page waits on it) | ``quit``; EOF (the shell went away) closes it.
stdout: ``loaded TITLE`` after each page load, ``action NAME`` from the welcome page.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path

from app import paths

TITLE = "omlx"


def _emit(kind: str, text: str = "") -> None:
    print(f"{kind} {text}".rstrip(), flush=True)


class WelcomeApi:
    """What the first-run page may ask for (pywebview's js_api, called off the GUI thread)."""

    def __init__(self, base_path: Path, server_url: str = ""):
        self._base_path = base_path
        # The admin page of the shell's server: "" until the shell has chosen its port.
        self.server_url = server_url
        # Private: pywebview hands the page the methods of every public attribute too,
        # and the page has no business calling the Window's (destroy, load_url, ...).
        self._window = None

    def bind(self, window) -> None:
        """The window this API serves (it exists only after create_window took the API)."""
        self._window = window

    def open_admin(self) -> bool:
        """Load the shell's admin page once its server answers there; False until then.
        Loaded from here, not by the page: Qt WebEngine refuses a file:// page's fetch of,
        or navigation to, an http:// address (ERR_NETWORK_ACCESS_DENIED)."""
        import httpx

        url = self.server_url
        if not url or self._window is None:
            return False
        try:
            httpx.get(url, timeout=2.0, trust_env=False)
        except httpx.HTTPError:
            return False
        self._window.load_url(url)
        return True

    def info(self) -> dict[str, str]:
        from omlx.settings import load_settings

        settings = load_settings({"base_path": str(self._base_path)})
        return {"model_dir": str(settings.model_dirs[0]), "base_path": str(self._base_path)}

    def choose_model_dir(self) -> str | None:
        import webview

        window = self._window
        picked = window.create_file_dialog(webview.FileDialog.FOLDER) if window else None
        if not picked:
            return None
        from omlx.settings import set_file_value

        set_file_value(self._base_path, "models.model_dirs", [str(picked[0])])
        return str(picked[0])

    def start_server(self) -> bool:
        _emit("action", "start")
        return True

    def install_model(self) -> str:
        cmd = paths.omlx_command("--base-path", str(self._base_path), "models", "install-default")
        done = subprocess.run(cmd, cwd=paths.child_cwd(), capture_output=True, text=True)
        return (done.stdout + done.stderr).strip()


def _commands(window, api: WelcomeApi | None) -> None:
    for raw in sys.stdin:
        cmd, _, arg = raw.strip().partition(" ")
        if cmd == "focus":
            # Un-minimize, raise and activate (Qt); make key and activate the app (Cocoa).
            # Not an on_top toggle: on Qt changing window flags unmaps the window.
            window.restore()
            window.show()
        elif cmd == "navigate":
            window.load_url(arg)
        elif cmd == "server" and api is not None:
            api.server_url = arg
        elif cmd == "quit":
            break
    window.destroy()


def _dock_entry_while_open(window) -> None:
    """macOS: a Dock and ⌘-Tab entry while the window is open, none once it closes.

    The bundle is a menu-bar app (LSUIElement), so this process starts without one and
    its window gets lost behind others. pywebview's cocoa backend also asks for the
    regular policy when imported, before the app has launched; this does it once the
    window shows, activates it, and gives the entry back when the window closes.
    """
    from AppKit import (
        NSApplication,
        NSApplicationActivationPolicyAccessory,
        NSApplicationActivationPolicyRegular,
    )
    from PyObjCTools import AppHelper

    def set_policy(policy: int, activate: bool) -> None:  # main thread only
        app = NSApplication.sharedApplication()
        app.setActivationPolicy_(policy)
        if activate:
            app.activateIgnoringOtherApps_(True)

    # pywebview runs these handlers on worker threads: hand them to the main thread.
    window.events.shown += lambda: AppHelper.callAfter(
        set_policy, NSApplicationActivationPolicyRegular, True
    )
    window.events.closed += lambda: AppHelper.callAfter(
        set_policy, NSApplicationActivationPolicyAccessory, False
    )


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="omlx-window")
    parser.add_argument("--url", required=True)
    parser.add_argument("--base-path", type=Path, required=True)
    parser.add_argument("--welcome", action="store_true")
    args = parser.parse_args(argv)
    if sys.platform.startswith("linux") and hasattr(os, "geteuid") and os.geteuid() == 0:
        # Chromium refuses to run its sandbox as root.
        os.environ.setdefault("QTWEBENGINE_CHROMIUM_FLAGS", "--no-sandbox")
    import webview

    api = WelcomeApi(args.base_path, args.url) if args.welcome else None
    url = paths.welcome_page().as_uri() if args.welcome else args.url
    window = webview.create_window(TITLE, url, width=1180, height=800, js_api=api)
    if api is not None:
        api.bind(window)

    def loaded() -> None:
        # run_js, not evaluate_js: that wraps the script in eval(), which the admin
        # panel's Content-Security-Policy refuses.
        _emit("loaded", str(window.run_js("document.title") or ""))

    window.events.loaded += loaded
    if sys.platform == "darwin":
        _dock_entry_while_open(window)
    threading.Thread(target=_commands, args=(window, api), daemon=True).start()
    webview.start(gui="cocoa" if sys.platform == "darwin" else "qt")
    _emit("closed")
    return 0
