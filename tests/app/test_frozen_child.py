"""A spawned child of the frozen app (issue 23, item 4): the GGUF import through the
admin API, in an omlx.app layout started the way py2app 0.28 starts it.

The layout stands in for py2app's pieces: ``Contents/MacOS/omlx`` (its C stub:
exports RESOURCEPATH, ARGVZERO and EXECUTABLEPATH, then runs the bootstrap),
``Contents/MacOS/python`` (the bare interpreter, which is ``sys.executable``), and a
bootstrap that sets ``sys.frozen = "macosx_app"`` and runs
``Resources/app_main.py`` in ``__main__`` with ``sys.argv[0]`` pointing at it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.servers import free_port
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.test_gguf_crafted import tiny_llama_gguf_bytes

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-frozen-child"
HEADERS = {"Authorization": f"Bearer {KEY}", "X-Omlx-Client": "test"}

STUB = """#!/bin/sh
here="$(cd "$(dirname "$0")" && pwd)"
export RESOURCEPATH="$here/../Resources" ARGVZERO="$0" EXECUTABLEPATH="$here/omlx"
exec "$here/python" "$RESOURCEPATH/__boot__.py" "$@"
"""
BOOT = """import os, sys
sys.frozen = "macosx_app"
path = os.path.join(os.environ["RESOURCEPATH"], "app_main.py")
sys.argv[0] = __file__ = path
with open(path, encoding="utf-8") as fp:
    source = fp.read()
exec(compile(source, path, "exec"), globals(), globals())
"""


def make_bundle(root: Path) -> Path:
    contents = root / "omlx.app" / "Contents"
    (contents / "MacOS").mkdir(parents=True)
    (contents / "Resources").mkdir()
    stub = contents / "MacOS" / "omlx"
    stub.write_text(STUB)
    stub.chmod(0o755)
    (contents / "MacOS" / "python").symlink_to(os.path.realpath(sys.executable))
    (contents / "Resources" / "__boot__.py").write_text(BOOT)
    shutil.copy(ROOT / "packaging" / "app_main.py", contents / "Resources" / "app_main.py")
    return stub


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


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX launcher")
def test_the_frozen_apps_gguf_import_child_runs_the_import(tmp_path: Path) -> None:
    stub = make_bundle(tmp_path)
    models = tmp_path / "models"
    build_tiny_model(models / "tiny-llama", "llama", seed=0)
    gguf = tmp_path / "tiny.gguf"
    (tmp_path / "gguf-src").mkdir()
    gguf.write_bytes(tiny_llama_gguf_bytes(tmp_path / "gguf-src"))
    port = free_port()
    # The bundle carries its libraries; here they are this checkout and this venv's.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]]),
    }
    args = ["--omlx-cli", "--base-path", str(tmp_path / "base"), "serve"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--model-dir", str(models)]
    args += ["--no-install-default", "--api-key", KEY]
    server = subprocess.Popen(
        [str(stub), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
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
