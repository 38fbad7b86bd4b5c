"""Every kind of child the frozen app starts, under py2app 0.28.10's own boot (issue 37).

The layout (tests/app/frozen_layout.py) runs py2app's real ``__boot__.py``, with
its multiprocessing recipe's prescript: a spawned child's command line is
``sys.executable -B -c "...spawn_main(...)" --multiprocessing-fork``. The server
runs on the launcher (``--omlx-cli``); its GGUF import and install-default run in
spawned children, its oQ task and ``omlx pull``'s download in ``python -m``
workers, the window on the launcher (``--omlx-window``). Each completes its job
here; the launcher refuses a Python command line with a message naming it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.models.builtin import BUILTIN_MODEL_NAME, is_complete_model_folder
from tests.app.frozen_layout import ALERT_MARKER, bundle_env, make_bundle
from tests.app.test_frozen_child import run_launcher
from tests.app.xvfb import xvfb_display
from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.servers import free_port
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.test_gguf_crafted import tiny_llama_gguf_bytes

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a POSIX launcher")

REPO = "mlx-community/tiny-llama"
KEY = "sk-frozen-child"
HEADERS = {"Authorization": f"Bearer {KEY}", "X-Omlx-Client": "test"}
NOT_PYTHON = "the omlx.app launcher runs the app, not Python"


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bundle(tmp_path_factory.mktemp("bundle"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    model = build_tiny_model(tmp_path_factory.mktemp("hub-src") / "tiny", "llama", seed=4)
    with FakeHub() as fake:
        fake.add_folder(REPO, model)
        yield fake


def hub_env(hub: FakeHub, base: Path) -> dict[str, str]:
    env = {k: v for k, v in bundle_env().items() if k not in ("HF_TOKEN", "HF_ENDPOINT")}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(base / "hf-home")}


class FrozenServer:
    def __init__(self, base_url: str, models: Path, stderr: Path):
        self.base_url, self.models, self.stderr = base_url, models, stderr
        self.http = httpx.Client(base_url=base_url, headers=HEADERS, timeout=300)


def wait_healthy(server: FrozenServer, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, server.stderr.read_text()[-3000:]
        try:
            if server.http.get("/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the frozen server never answered /health")


@pytest.fixture(scope="module")
def server(
    launcher: Path, hub: FakeHub, tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrozenServer]:
    root = tmp_path_factory.mktemp("frozen-server")
    models = root / "models"
    shutil.copytree(tiny_models_dir / "tiny-llama", models / "tiny-llama")
    port = free_port()
    args = ["--omlx-cli", "--base-path", str(root / "base"), "serve", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--model-dir", str(models), "--no-install-default"]
    stderr = root / "server-stderr.txt"
    with stderr.open("w") as sink:
        proc = subprocess.Popen(
            [str(launcher), *args, "--api-key", KEY],
            env=hub_env(hub, root),
            stdout=subprocess.DEVNULL,
            stderr=sink,
            text=True,
        )
    frozen = FrozenServer(f"http://127.0.0.1:{port}", models, stderr)
    try:
        wait_healthy(frozen, proc)
        yield frozen
    finally:
        frozen.http.close()
        proc.terminate()
        proc.wait(timeout=60)
    log = stderr.read_text()
    assert ALERT_MARKER not in log
    assert NOT_PYTHON not in log


def test_a_gguf_import_from_the_panel_runs_in_a_spawned_child(
    server: FrozenServer, tmp_path: Path
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(tiny_llama_gguf_bytes(tmp_path))
    body = {"path": str(gguf), "name": "imported"}
    response = server.http.post("/admin/api/models/import-gguf", json=body)
    assert response.status_code in (200, 201), response.text + server.stderr.read_text()[-3000:]
    assert (server.models / "imported" / "config.json").is_file()
    # One server: the child ran the import, not a second app.
    assert server.http.get("/health").status_code == 200


def test_install_default_runs_in_a_spawned_child(server: FrozenServer) -> None:
    response = server.http.post("/admin/api/models/install-default")
    assert response.status_code == 200, response.text + server.stderr.read_text()[-3000:]
    assert response.json()["already_installed"] is False
    assert is_complete_model_folder(server.models / BUILTIN_MODEL_NAME)


def test_an_oq_task_runs_in_its_python_m_worker(server: FrozenServer) -> None:
    body = {"model": "tiny-llama", "level": "oQ4", "output_name": "tiny-oq4"}
    started = server.http.post("/admin/api/quant/tasks", json=body)
    assert started.status_code == 201, started.text
    task_url = f"/admin/api/quant/tasks/{started.json()['id']}"
    deadline = time.monotonic() + 180
    while (task := server.http.get(task_url).json())["phase"] not in ("done", "failed"):
        assert time.monotonic() < deadline, f"the oQ task is stuck in {task['phase']}"
        time.sleep(0.2)
    assert task["phase"] == "done", task["error"]
    assert (server.models / "tiny-oq4" / "config.json").is_file()


def test_omlx_pull_runs_its_download_worker_from_the_hub(
    launcher: Path, hub: FakeHub, tmp_path: Path
) -> None:
    args = ["--omlx-cli", "--base-path", str(tmp_path), "pull", REPO, "--revision", "main"]
    done = run_launcher(launcher, *args, env=hub_env(hub, tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "models" / "tiny-llama" / "model.safetensors").is_file()
    assert hub.file_bytes_served(REPO, "model.safetensors") > 0


@pytest.mark.parametrize(
    "argv",
    [
        # multiprocessing's spawned child and resource tracker, as py2app's recipe makes them
        ["-B", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=9)",
         "--multiprocessing-fork"],
        ["-B", "-c", "from multiprocessing.resource_tracker import main;main(9)"],
        ["--multiprocessing-fork", "pipe_handle=9"],
        ["-m", "omlx.models.download_worker", REPO],
        ["script.py"],
    ],
    ids=["spawn", "resource-tracker", "bare-fork-flag", "python-m", "script"],
)  # fmt: skip
def test_the_launcher_refuses_a_python_command_line_and_names_it(
    launcher: Path, argv: list[str]
) -> None:
    done = run_launcher(launcher, *argv, env=bundle_env())
    assert done.returncode == 2, done.stderr[-3000:]
    assert NOT_PYTHON in done.stderr
    assert argv[-1] in done.stderr
    assert "usage: omlx-app" not in done.stderr  # never the shell's argument parser
    assert ALERT_MARKER not in done.stderr


def test_the_window_child_loads_the_admin_page_and_quits_cleanly(
    launcher: Path, server: FrozenServer, tmp_path: Path
) -> None:
    with xvfb_display() as display:
        args = ["--omlx-window", "--url", server.base_url + "/admin/", "--base-path", str(tmp_path)]
        window = subprocess.Popen(
            [str(launcher), *args],
            env={**bundle_env(), "DISPLAY": display},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert window.stdin is not None and window.stdout is not None
        try:
            first = window.stdout.readline()
            assert first.startswith("loaded "), window.communicate(timeout=30)[1][-3000:]
            assert "omlx" in first.lower()
            window.stdin.write("quit\n")
            window.stdin.flush()
            _, stderr = window.communicate(timeout=30)
        finally:
            if window.poll() is None:
                window.kill()
    assert window.returncode == 0, stderr[-3000:]
    assert ALERT_MARKER not in stderr
