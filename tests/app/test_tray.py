"""The Linux tray icon under Xvfb: the real app process, its icon in a tray host (trayer),
its menu opened with a real right-click and items chosen with the keyboard (xdotool).
The server it starts and stops is a real `omlx serve` child.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from app.ports import free_port
from tests.app.conftest import ARTIFACTS, wait_for
from tests.app.xvfb import painted_colors, xvfb_display

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_GI = Path("/usr/lib/python3/dist-packages/gi")
TOOLS = ("trayer", "xdotool", "xwininfo", "dbus-daemon")


def _gi_path(tmp_path: Path) -> Path:
    """Debian's PyGObject alone on a path (all of dist-packages would shadow the venv)."""
    compiled = list(
        DEBIAN_GI.glob(f"_gi.cpython-{sys.version_info.major}{sys.version_info.minor}*")
    )
    if not compiled:
        pytest.skip(f"no PyGObject for this Python at {DEBIAN_GI} (apt-get install python3-gi)")
    path = tmp_path / "gi-only"
    path.mkdir()
    (path / "gi").symlink_to(DEBIAN_GI)
    return path


def _tray_icon_center(display: str) -> tuple[int, int] | None:
    """Centre of trayer's panel once an icon is embedded in it (ours is the only one)."""
    tree = subprocess.run(
        ["xwininfo", "-display", display, "-root", "-tree"], capture_output=True, text=True
    ).stdout
    lines = tree.splitlines()
    for i, line in enumerate(lines):
        panel = re.search(r'\("panel" "trayer"\)\s+(\d+)x(\d+)\S*\s+\+(-?\d+)\+(-?\d+)', line)
        if panel and i + 1 < len(lines) and re.search(r"\d+ child", lines[i + 1]):
            w, h, x, y = map(int, panel.groups())
            return x + w // 2, y + h // 2
    return None


def _choose(display: str, icon: tuple[int, int], num_down: int) -> None:
    """Right-click the icon, then move down ``num_down`` enabled items and press Return."""
    env = {**os.environ, "DISPLAY": display}
    x, y = icon
    subprocess.run(["xdotool", "mousemove", str(x), str(y), "click", "3"], env=env, check=True)
    time.sleep(0.8)  # the menu maps and grabs the keyboard
    keys = ["Down"] * num_down + ["Return"]
    subprocess.run(["xdotool", "key", "--delay", "120", *keys], env=env, check=True)


def _visible_window(display: str, name: str) -> bool:
    done = subprocess.run(
        ["xdotool", "search", "--onlyvisible", "--name", f"^{name}$"],
        env={**os.environ, "DISPLAY": display},
        capture_output=True,
        text=True,
    )
    return bool(done.stdout.split())


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _health(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def _children_with(app: subprocess.Popen, marker: str) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(app.pid).children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def test_tray_menu_starts_server_opens_admin_and_stops(tmp_path, tiny_models_dir):
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"missing {', '.join(missing)} (setup.sh test installs them)")
    gi_path = _gi_path(tmp_path)
    port = free_port()
    base = tmp_path / "base"
    with xvfb_display() as display:
        env = {
            **os.environ,
            "DISPLAY": display,
            "PYSTRAY_BACKEND": "gtk",  # XEmbed icon in trayer; appindicator needs a SNI host
            "PYTHONPATH": f"{gi_path}{os.pathsep}{ROOT}",
        }
        bus = subprocess.run(
            ["dbus-daemon", "--session", "--fork", "--print-address=1", "--print-pid=1"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        env["DBUS_SESSION_BUS_ADDRESS"], bus_pid = bus[0], int(bus[1])
        trayer = subprocess.Popen(
            ["trayer", "--edge", "top", "--align", "right", "--widthtype", "request"],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        out = (tmp_path / "app-output.log").open("wb")
        app = subprocess.Popen(
            [
                sys.executable, "-m", "app", "--base-path", str(base), "--port", str(port),
                "--no-autostart", "--no-welcome",
                f"--serve-arg=--model-dir={tiny_models_dir}", "--serve-arg=--no-install-default",
            ],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            app_log = base / "logs" / "app.log"
            wait_for(lambda: "tray icon shown" in _read(app_log), 60, "the tray to be ready")
            wait_for(lambda: _tray_icon_center(display) is not None, 30, "the tray icon")
            icon = _tray_icon_center(display)
            assert _health(port) is None  # --no-autostart: nothing runs yet

            _choose(display, icon, 1)  # stopped: the first enabled item is Start Server
            wait_for(lambda: _health(port) == 200, 90, "the server started from the menu")
            assert len(_children_with(app, "omlx.cli")) == 1
            # The monitor sees it running and rebuilds the menu (then GTK shows it).
            wait_for(lambda: "tray menu: Running" in _read(app_log), 30, "the running menu")
            time.sleep(0.3)

            _choose(display, icon, 3)  # running: Stop, Restart, Open Admin
            wait_for(lambda: _children_with(app, "--omlx-window"), 30, "the admin window")
            wait_for(lambda: _visible_window(display, "omlx"), 60, "the admin window to map")
            assert painted_colors(display, ARTIFACTS / "tray-and-admin.png") > 50

            _choose(display, icon, 1)  # running: Stop Server
            wait_for(lambda: _health(port) is None, 30, "the server stopped from the menu")
            wait_for(lambda: not _children_with(app, "omlx.cli"), 30, "the server process gone")
            assert app.poll() is None  # stopping the server does not quit the shell
        finally:
            if app.poll() is None:
                app.send_signal(signal.SIGTERM)  # quits like the menu's Quit
                app.wait(30)
            trayer.terminate()
            trayer.wait(10)
            os.kill(bus_pid, signal.SIGTERM)
            out.close()
    assert "starting:" in _read(app_log) and "omlx.cli" in _read(app_log)
