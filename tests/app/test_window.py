"""The admin window: a real pywebview (Qt) window on the live server's /admin/, under Xvfb."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from app.controller import ADMIN_PATH, STATE_FILE, AppConfig, Controller
from app.ports import free_port
from app.status import ServerState
from app.window import AdminWindow
from tests.app.conftest import ARTIFACTS, wait_for
from tests.app.xvfb import painted_colors, screenshot, xvfb_display
from tests.fixtures.servers import live_server

ADMIN_TITLE = "omlx admin"  # web/index.html, after the page's own prefix


@pytest.fixture(scope="module")
def display() -> str:
    with xvfb_display() as name:
        yield name


def _windows_named(display: str, name: str) -> list[str]:
    done = subprocess.run(
        ["xdotool", "search", "--onlyvisible", "--name", f"^{name}$"],
        env={"DISPLAY": display},
        capture_output=True,
        text=True,
    )
    return done.stdout.split()


def test_admin_window_renders_the_admin_page_and_reopen_focuses(
    display, tmp_path: Path, tiny_models_dir: Path, monkeypatch, profiles_dir: Path
):
    monkeypatch.setenv("DISPLAY", display)
    with live_server(tmp_path / "base", tiny_models_dir, profiles=profiles_dir) as server:
        window = AdminWindow(tmp_path / "base")
        try:
            assert window.open(server.base_url + ADMIN_PATH) is True
            title = window.wait_loaded(90)
            assert title is not None, "the page never finished loading"
            assert "omlx" in title.lower()
            wait_for(lambda: len(_windows_named(display, "omlx")) == 1, 20, "the window")
            # a rendered page, not an empty black screen
            assert painted_colors(display, ARTIFACTS / "admin-window.png") > 50

            pid = window.pid
            assert window.open(server.base_url + ADMIN_PATH) is False  # focused, not a second
            assert window.pid == pid and window.num_opened == 1
            assert len(_windows_named(display, "omlx")) == 1
        finally:
            window.close()
        assert not window.is_open()
        wait_for(lambda: not _windows_named(display, "omlx"), 10, "the window to close")


def _press_start_server(display: str) -> None:
    """Keyboard, as a person would: the welcome page's third button is "Start server"."""
    env = {**os.environ, "DISPLAY": display}
    (window_id,) = _windows_named(display, "omlx")
    subprocess.run(["xdotool", "windowfocus", "--sync", window_id], env=env, check=True)
    # A click on blank page area puts keyboard focus into the web view.
    subprocess.run(["xdotool", "mousemove", "640", "700", "click", "1"], env=env, check=True)
    subprocess.run(["xdotool", "key", "--delay", "150", "Tab", "Tab", "Tab", "Return"],
                   env=env, check=True)  # fmt: skip


@contextmanager
def other_program_on_a_port() -> Iterator[tuple[int, list[bytes]]]:
    """A listening socket that is not omlx: it answers nothing and records what it is sent."""
    received: list[bytes] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        done = threading.Event()

        def serve() -> None:
            while not done.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(1.0)
                    with suppress(OSError):
                        received.append(conn.recv(4096))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield server.getsockname()[1], received
        finally:
            done.set()
            thread.join(5)


def test_welcome_page_waits_on_the_port_the_shell_picked(
    display, tmp_path: Path, tiny_models_dir: Path, monkeypatch
):
    """Another program holds the configured port: the shell starts on a free one, and the
    welcome page opens the admin panel there, never sending the other program a request."""
    monkeypatch.setenv("DISPLAY", display)
    args = ("--model-dir", str(tiny_models_dir), "--no-install-default")
    with other_program_on_a_port() as (held, received):
        controller = Controller(AppConfig(base_path=tmp_path / "base", port=held, extra_args=args))
        controller.start_monitor()
        try:
            # As the menu bar and the tray do at launch: the page first, then the start.
            assert controller.first_run() is True
            assert controller.window.wait_loaded(90) == "Welcome to omlx"
            controller.dispatch("start").result(30)
            port = controller.status.port
            assert port is not None and port != held
            assert controller.window.server_url == f"http://127.0.0.1:{port}{ADMIN_PATH}"
            time.sleep(2)  # pywebview injects its js_api just after the load event
            _press_start_server(display)
            # The admin panel's own title ("Dashboard · omlx admin"), not an error page's.
            wait_for(
                lambda: (controller.window.page_title or "").endswith(ADMIN_TITLE),
                120,
                "the welcome page to open the admin panel",
            )
            # The menu bar follows at its next health poll (one a second; slower on a busy host).
            wait_for(
                lambda: controller.status.state is ServerState.RUNNING,
                30,
                "the menu bar to show the server running",
            )
            assert controller.status.port == port
        finally:
            controller.shutdown()
        # The shell's own probe asked the other program for /health; the page asked nothing.
        assert not [r for r in received if ADMIN_PATH.encode() in r], received


def test_first_run_welcome_page_starts_the_server(
    display, tmp_path: Path, tiny_models_dir: Path, monkeypatch
):
    monkeypatch.setenv("DISPLAY", display)
    base = tmp_path / "base"
    args = ("--model-dir", str(tiny_models_dir), "--no-install-default")
    controller = Controller(AppConfig(base_path=base, port=free_port(), extra_args=args))
    controller.start_monitor()
    try:
        assert controller.first_run() is True
        assert controller.window.wait_loaded(90) == "Welcome to omlx"
        time.sleep(2)  # pywebview injects its js_api just after the load event
        screenshot(display, ARTIFACTS / "welcome.png")
        _press_start_server(display)
        wait_for(lambda: controller.status.state is ServerState.RUNNING, 90, "the server")
    finally:
        controller.shutdown()
    assert json.loads((base / STATE_FILE).read_text()) == {"welcomed": True}
    again = Controller(AppConfig(base_path=base, port=free_port()))
    assert again.first_run() is False and not again.window.is_open()
