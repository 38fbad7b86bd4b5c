"""The admin window: one pywebview child process at a time; opening it again focuses it.

A child process, because pywebview owns its GUI toolkit's main loop and the tray (or
AppKit status item) owns ours. They talk over lines on stdin/stdout (see app.webview_main).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from app import paths
from app.console_log import ConsoleLog

log = logging.getLogger("omlx.app")


class AdminWindow:
    def __init__(self, base_path: Path, on_action: Callable[[str], None] | None = None):
        self.base_path = base_path
        self._on_action = on_action or (lambda _name: None)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._loaded = threading.Event()
        self._console: ConsoleLog | None = None
        self._server_url: str | None = None
        self.page_title: str | None = None
        self.num_opened = 0

    def is_open(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.is_open() and self._proc is not None else None

    @property
    def server_url(self) -> str | None:
        """The admin page of the server the shell runs now, as last told by show_server."""
        return self._server_url

    def show_server(self, admin_url: str | None) -> None:
        """Where the shell's server is (None: no port chosen yet). The welcome page waits on
        this address, never on the configured port: the shell may have picked another."""
        with self._lock:
            if admin_url == self._server_url:
                return
            self._server_url = admin_url
            if self.is_open():
                self._send(f"server {admin_url or ''}".rstrip())

    def open_welcome(self) -> bool:
        """The first-run page, told where the server is now and of every change after."""
        return self.open("", welcome=True)

    def open(self, url: str, *, welcome: bool = False) -> bool:
        """Show ``url``; True if a new window opened, False if the open one was focused.
        With ``welcome``, the first-run page on the server show_server named (else ``url``)."""
        with self._lock:
            if welcome:
                url = self._server_url or url
            if self.is_open():
                self._send(f"navigate {url}" if welcome and url else "focus")
                return False
            self._loaded.clear()
            self.page_title = None
            args = ["--url", url, "--base-path", str(self.base_path)]
            if welcome:
                args.append("--welcome")
            self._proc = subprocess.Popen(
                paths.window_command(*args),
                cwd=paths.child_cwd(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            assert self._proc.stderr is not None
            self._console_log().copy_from(self._proc.stderr.buffer, "window")
            self.num_opened += 1
            threading.Thread(target=self._read_events, args=(self._proc,), daemon=True).start()
            return True

    def wait_loaded(self, timeout_s: float) -> str | None:
        """The page's document.title once it has loaded (None on timeout or exit)."""
        self._loaded.wait(timeout_s)
        return self.page_title

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            if proc.poll() is None:
                self._send("quit")
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._proc = None

    def _send(self, line: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            log.warning("admin window did not take %r", line)

    def _console_log(self) -> ConsoleLog:
        """window.log: what the window process and its web engine print (size-rotated)."""
        if self._console is None:
            self._console = ConsoleLog(paths.log_dir(self.base_path) / "window.log")
        return self._console

    def _read_events(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            kind, _, rest = raw.rstrip("\n").partition(" ")
            if kind == "loaded":
                self.page_title = rest
                self._loaded.set()
            elif kind == "action":
                self._on_action(rest)
        self._loaded.set()  # the window process ended: nobody waits for a load any more
