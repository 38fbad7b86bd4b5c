"""packaging/smoke.py (issue 23, item 12) run for real against the omlx.app layout
of tests/app/frozen_layout.py: the server through the bundle's launcher, the built-in
model installed and answering through the admin API's spawned child, a json_schema
answer, a GGUF import, and the desktop shell (under Xvfb) quitting and being killed
without leaving its server behind. What only a Mac shows (Cocoa, the signed bundle,
Apple Events) the macOS workflow runs with the same script against dist/omlx.app.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omlx import __version__
from tests.app.frozen_layout import ROOT, broken_package, bundle_env, make_bundle
from tests.app.test_tray import _gi_path
from tests.app.xvfb import xvfb_display
from tests.unit.test_gguf_crafted import tiny_llama_gguf_bytes

SMOKE = ROOT / "packaging" / "smoke.py"
SERVER_STEPS = [
    *("version", "serve", "install-builtin", "chat", "json-schema", "import-gguf"),
    *("chat-imported", "oq-task", "chat-oq", "hub-pull", "chat-pulled"),
]
SHELL_STEPS = [
    *("shell-start", "shell-quit-sigterm", "shell-restart", "shell-sigkill"),
    *("shell-port-taken", "shell-quit-port-taken"),
]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a POSIX launcher")


def run_smoke(launcher: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    work = launcher.parents[3] / "smoke-work"
    cmd = [sys.executable, str(SMOKE), "--launcher", str(launcher), "--work-dir", str(work)]
    cmd += args
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def passed_steps(stdout: str) -> list[str]:
    return re.findall(r"^ok +(\S+) +[\d.]+s ", stdout, flags=re.MULTILINE)


def bundle_processes(app: Path) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-A", "-o", "args="], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.startswith(str(app))]


@pytest.fixture
def desktop_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The bundle's environment with what the Linux shell needs: an X display, a
    session bus, and GTK (Debian's PyGObject) for the tray icon."""
    missing = [tool for tool in ("Xvfb", "dbus-daemon") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"missing {', '.join(missing)} (setup.sh test installs them)")
    gi_path = _gi_path(tmp_path)
    with xvfb_display() as display:
        bus = subprocess.run(
            ["dbus-daemon", "--session", "--fork", "--print-address=1", "--print-pid=1"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        env = bundle_env(gi_path)
        env.update(DISPLAY=display, PYSTRAY_BACKEND="gtk", DBUS_SESSION_BUS_ADDRESS=bus[0])
        try:
            yield env
        finally:
            os.kill(int(bus[1]), signal.SIGTERM)


@pytest.mark.slow
def test_the_smoke_test_passes_every_step_on_the_frozen_layout(
    tmp_path: Path, desktop_env: dict[str, str]
) -> None:
    launcher = make_bundle(tmp_path)
    (tmp_path / "gguf-src").mkdir()
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(tiny_llama_gguf_bytes(tmp_path / "gguf-src"))
    done = run_smoke(
        launcher, "--expect-version", __version__, "--gguf", str(gguf), env=desktop_env
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert passed_steps(done.stdout) == [*SERVER_STEPS, "stop-server", *SHELL_STEPS]
    assert "answer {" in done.stdout  # the json_schema step printed the parsed answer
    assert bundle_processes(tmp_path / "omlx.app") == []


def test_a_broken_bundle_fails_at_its_step_with_the_servers_traceback(tmp_path: Path) -> None:
    # mlx without its native core: `--version` still works, `serve` cannot start.
    launcher = make_bundle(tmp_path)
    broken = broken_package(tmp_path, "mlx", "libmlx.dylib not found (broken bundle)")
    done = run_smoke(
        launcher, "--expect-version", __version__, "--skip-shell", env=bundle_env(broken)
    )
    assert done.returncode == 1
    assert passed_steps(done.stdout) == ["version"]
    assert re.search(r"^FAIL serve .* exited with 1 before /health", done.stdout, re.MULTILINE)
    assert "ImportError: libmlx.dylib not found (broken bundle)" in done.stdout  # the log tail
    assert bundle_processes(tmp_path / "omlx.app") == []


def test_a_wrong_version_fails_the_first_step(tmp_path: Path) -> None:
    launcher = make_bundle(tmp_path)
    done = run_smoke(launcher, "--expect-version", "9.9.9", "--skip-shell", env=bundle_env())
    assert done.returncode == 1
    assert f"expected version 9.9.9, the app says 'omlx {__version__}'" in done.stdout
    assert passed_steps(done.stdout) == []
