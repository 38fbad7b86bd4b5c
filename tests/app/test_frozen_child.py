"""The frozen app's children when they fail (issue 23, item 7), in an omlx.app layout
started the way py2app 0.28 starts it (see tests/app/frozen_layout.py).

A child on the launcher that crashes exits 1 with its traceback on stderr and never
reaches the path where py2app's launcher shows its modal alert; the shell, which has
no menu to report with when it cannot start, still does. Every child kind doing its
job (issue 23 item 4, issue 37) is in test_frozen_children.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.frozen_layout import ALERT_MARKER, broken_package, bundle_env, make_bundle
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a POSIX launcher")


def run_launcher(launcher: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(launcher), *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_server_child_that_crashes_exits_1_with_its_traceback_and_no_alert(
    tmp_path: Path,
) -> None:
    # A bundle whose mlx lost its native core: `omlx serve` fails at `import mlx.core`.
    launcher = make_bundle(tmp_path)
    broken = broken_package(tmp_path, "mlx", "libmlx.dylib not found (broken bundle)")
    args = ["--omlx-cli", "--base-path", str(tmp_path / "base"), "serve"]
    args += ["--port", str(free_port()), "--no-install-default"]
    done = run_launcher(launcher, *args, env=bundle_env(broken))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback (most recent call last)" in done.stderr
    assert "ImportError: libmlx.dylib not found (broken bundle)" in done.stderr
    assert ALERT_MARKER not in done.stderr


def test_a_window_child_whose_module_fails_exits_1_with_its_traceback_and_no_alert(
    tmp_path: Path,
) -> None:
    launcher = make_bundle(tmp_path)
    broken = broken_package(tmp_path, "webview", "no GUI backend for pywebview")
    args = ["--omlx-window", "--url", "http://127.0.0.1:9/", "--base-path", str(tmp_path)]
    done = run_launcher(launcher, *args, env=bundle_env(broken))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "ImportError: no GUI backend for pywebview" in done.stderr
    assert ALERT_MARKER not in done.stderr


def test_the_shell_that_cannot_start_logs_why_and_keeps_the_launchers_alert(
    tmp_path: Path,
) -> None:
    # The stand-in launcher does detect the alert path; the shell (no menu yet) takes it.
    launcher = make_bundle(tmp_path)
    base = tmp_path / "base"
    base.mkdir()
    (base / "settings.json").write_text("{not json")
    done = run_launcher(
        launcher, "--base-path", str(base), "--no-autostart", "--no-welcome", env=bundle_env()
    )
    assert done.returncode == 255, done.stderr[-3000:]
    assert ALERT_MARKER in done.stderr
    app_log = (base / "logs" / "app.log").read_text()
    assert "omlx could not start" in app_log
    assert "settings.json is not valid JSON" in app_log
