"""The frozen app's children (issue 23, items 4 and 7), in an omlx.app layout started
the way py2app 0.28 starts it (see tests/app/frozen_layout.py).

Item 4: a spawned child (the GGUF import through the admin API) runs its job, not a
second app. Item 7: a child that crashes exits 1 with its traceback on stderr and
never reaches the path where py2app's launcher shows its modal alert; the shell,
which has no menu to report with when it cannot start, still does.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.app.frozen_layout import ALERT_MARKER, broken_package, bundle_env, make_bundle
from tests.fixtures.servers import free_port
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.test_gguf_crafted import tiny_llama_gguf_bytes

KEY = "sk-frozen-child"
HEADERS = {"Authorization": f"Bearer {KEY}", "X-Omlx-Client": "test"}

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a POSIX launcher")


def wait_healthy(base_url: str, server: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, server.communicate()[1][-3000:]
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the frozen server never answered /health")


def test_the_frozen_apps_gguf_import_child_runs_the_import(tmp_path: Path) -> None:
    launcher = make_bundle(tmp_path)
    models = tmp_path / "models"
    build_tiny_model(models / "tiny-llama", "llama", seed=0)
    gguf = tmp_path / "tiny.gguf"
    (tmp_path / "gguf-src").mkdir()
    gguf.write_bytes(tiny_llama_gguf_bytes(tmp_path / "gguf-src"))
    port = free_port()
    args = ["--omlx-cli", "--base-path", str(tmp_path / "base"), "serve"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--model-dir", str(models)]
    args += ["--no-install-default", "--api-key", KEY]
    server = subprocess.Popen(
        [str(launcher), *args],
        env=bundle_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, server)
        response = httpx.post(
            base_url + "/admin/api/models/import-gguf",
            json={"path": str(gguf), "name": "imported"},
            headers=HEADERS,
            timeout=300,
        )
        assert response.status_code in (200, 201), response.text
        assert (models / "imported" / "config.json").is_file()
        # One server: the child ran the import, not a second app.
        assert httpx.get(base_url + "/health", timeout=10).status_code == 200
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=60)
    assert "Address already in use" not in stderr
    # multiprocessing's resource tracker (`<launcher> -c ...`) ran, not the shell's parser.
    assert "unrecognized arguments" not in stderr
    assert ALERT_MARKER not in stderr


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


def test_a_spawned_child_whose_parent_pipe_is_gone_exits_1_and_no_alert(tmp_path: Path) -> None:
    # What multiprocessing runs in a spawned child, with a pipe that no longer exists.
    launcher = make_bundle(tmp_path)
    done = run_launcher(launcher, "--multiprocessing-fork", "pipe_handle=987", env=bundle_env())
    assert done.returncode == 1, done.stderr[-3000:]
    assert "OSError: [Errno 9] Bad file descriptor" in done.stderr
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
