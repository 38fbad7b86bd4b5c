"""One-click GGUF: a GGUF of a Hub repo downloaded and imported into a model folder.

The fake Hub serves a real K-quant GGUF written here (tests/fixtures/gguf_files.py)
from a tiny Qwen 3; the real huggingface_hub downloads it in the worker child, the
import runs in the import child, and the model answers /v1. Through the admin API and
through `omlx pull --gguf` as a real process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from omlx.api.server import Server
from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.servers import ROOT, live_server
from tests.fixtures.tiny_models import build_tiny_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
Q4_K_M = {".v_proj": Q.Q6_K, "down_proj": Q.Q6_K, "lm_head": Q.Q6_K, "default": Q.Q4_K}
REPO = "someone/tiny-qwen3-GGUF"
GGUF = "tiny-qwen3.Q4_K_M.gguf"
BROKEN = "someone/int-tensors-GGUF"
DOWNLOADS = "/admin/api/models/downloads"
FINISHED = {"done", "failed", "cancelled"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    from tests.fixtures.gguf_files import finish, write_model_gguf

    root = tmp_path_factory.mktemp("gguf-src")
    write_model_gguf(build_tiny_model(root / "qwen3", "gguf-qwen3"), root / GGUF, Q4_K_M)
    # A GGUF whose only tensor is int32: the importer refuses it, naming the type.
    writer = gguf.GGUFWriter(str(root / "ints.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.int32))
    finish(writer)
    with FakeHub() as fake:
        fake.add_repo(
            REPO,
            {GGUF: (root / GGUF).read_bytes(), "README.md": b"# tiny"},
            tags=["gguf"],
        )
        fake.add_repo(BROKEN, {"ints.Q8_0.gguf": (root / "ints.gguf").read_bytes()})
        yield fake


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    return folder


@pytest.fixture
def server(hub: FakeHub, model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    hub.bytes_per_s = None
    with live_server(tmp_path / "base", model_dir, models={"hf_endpoint": hub.url}) as srv:
        yield srv


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    headers = {"X-Omlx-Client": "admin"}  # what the panel sends with a bodyless POST
    with httpx.Client(base_url=server.base_url, timeout=120, headers=headers) as client:
        yield client


def follow(http: httpx.Client, task_id: str, timeout_s: float = 180) -> tuple[Any, list[str]]:
    """Poll the task to a final phase; also the phases seen on the way."""
    deadline, seen = time.monotonic() + timeout_s, []
    while (task := http.get(f"{DOWNLOADS}/{task_id}").json())["phase"] not in FINISHED:
        if not seen or seen[-1] != task["phase"]:
            seen.append(task["phase"])
        assert time.monotonic() < deadline, f"stuck in {task['phase']}: {task}"
        time.sleep(0.05)
    return task, seen


def listed(http: httpx.Client) -> set[str]:
    return {m["id"] for m in http.get("/v1/models").json()["data"]}


def leftovers(model_dir: Path) -> list[str]:
    """Every file or folder in the model dir (hidden ones included)."""
    return sorted(p.name for p in model_dir.iterdir())


def chat(base_url: str, model: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_admin_download_of_a_gguf_imports_it_and_it_answers(
    http: httpx.Client, hub: FakeHub, model_dir: Path, server: Server
) -> None:
    inspected = http.post(f"{DOWNLOADS}/inspect", json={"repo_id": REPO}).json()
    assert inspected["kind"] == "gguf"
    assert inspected["gguf_files"] == [{"name": GGUF, "size": len(hub.repos[REPO].files[GGUF])}]

    reply = http.post(DOWNLOADS, json={"repo_id": REPO, "gguf_file": GGUF, "dtype": "keep"})
    assert reply.status_code == 201, reply.text
    task = reply.json()["task"]
    assert (task["name"], task["gguf_file"], task["dtype"]) == ("tiny-qwen3.Q4_K_M", GGUF, "keep")
    assert task["bytes_total"] == len(hub.repos[REPO].files[GGUF])  # the one file only
    done, seen = follow(http, task["id"])
    assert done["phase"] == "done", done
    assert "importing" in seen
    conversion = done["result"]["conversion"]
    assert conversion["tensor_types"]["Q4_K"]["became"].startswith("kept as MLX 4-bit")
    assert conversion["model_type"] == "qwen3" and done["result"]["gguf_removed"] is True
    assert done["fit"]["verdict"] == "fits"  # from the imported folder
    # The README was not fetched; the GGUF is gone; a plain model folder remains.
    assert hub.file_bytes_served(REPO, "README.md") == 0
    assert leftovers(model_dir) == ["tiny-qwen3.Q4_K_M"]
    assert not list(model_dir.rglob("*.gguf"))
    assert "tiny-qwen3.Q4_K_M" in listed(http)
    assert chat(server.base_url, "tiny-qwen3.Q4_K_M")["usage"]["completion_tokens"] >= 1


def test_cli_pull_gguf_shows_the_bar_then_the_import(
    hub: FakeHub, tmp_path: Path, model_dir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"))
    env["OMLX_MODELS__MODEL_DIRS"] = f'["{model_dir}"]'
    cmd = [sys.executable, "-m", "omlx.cli", "--base-path", str(tmp_path / "base"), "pull"]
    args = [REPO, "--gguf", GGUF, "--name", "from-cli", "--dtype", "float16"]
    proc = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "MB/s" in proc.stderr  # the progress bar
    assert f"importing {GGUF}" in proc.stdout
    assert "(qwen3, float16)" in proc.stdout and "the GGUF was removed" in proc.stdout
    assert "Q4_K: 11 tensors dequantized to float16" in proc.stdout
    assert leftovers(model_dir) == ["from-cli"]
    with live_server(tmp_path / "serve", model_dir) as srv:
        served = httpx.get(srv.base_url + "/v1/models").json()["data"]
        assert "from-cli" in {m["id"] for m in served}
        assert chat(srv.base_url, "from-cli")["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_cancelled_gguf_download_leaves_no_model(
    http: httpx.Client, hub: FakeHub, model_dir: Path
) -> None:
    hub.bytes_per_s = 20_000  # the ~1 MB file would take ~50 s
    task = http.post(DOWNLOADS, json={"repo_id": REPO, "gguf_file": GGUF}).json()["task"]
    time.sleep(1.5)  # the worker child is fetching the file
    assert http.get(f"{DOWNLOADS}/{task['id']}").json()["phase"] == "downloading"
    cancelled = http.post(f"{DOWNLOADS}/{task['id']}/cancel").json()
    hub.bytes_per_s = None
    assert cancelled["phase"] == "cancelled" and cancelled["result"] is None
    assert "tiny-qwen3.Q4_K_M" not in listed(http)
    assert all(name.startswith(".") for name in leftovers(model_dir))  # nothing listable
    assert http.delete(f"{DOWNLOADS}/{task['id']}").status_code == 204
    assert leftovers(model_dir) == []  # removing the task drops its partial file


def test_a_cancel_while_importing_stops_the_import_and_leaves_no_model(
    http: httpx.Client, model_dir: Path
) -> None:
    task = http.post(DOWNLOADS, json={"repo_id": REPO, "gguf_file": GGUF}).json()["task"]
    deadline = time.monotonic() + 60
    while http.get(f"{DOWNLOADS}/{task['id']}").json()["phase"] != "importing":
        assert time.monotonic() < deadline, "never reached importing"
        time.sleep(0.02)
    # The import child (a fresh Python importing MLX) is seconds from done: stopped.
    cancelled = http.post(f"{DOWNLOADS}/{task['id']}/cancel").json()
    assert cancelled["phase"] == "cancelled", cancelled
    assert "tiny-qwen3.Q4_K_M" not in listed(http)
    # Only the hidden partial folder with the downloaded GGUF stays, for a later download.
    assert leftovers(model_dir) == [".tiny-qwen3.Q4_K_M.download-partial"]
    again = http.post(DOWNLOADS, json={"repo_id": REPO, "gguf_file": GGUF}).json()["task"]
    assert follow(http, again["id"])[0]["phase"] == "done"
    assert leftovers(model_dir) == ["tiny-qwen3.Q4_K_M"]


def test_a_file_not_in_the_repo_is_400_naming_the_files_that_are(
    http: httpx.Client, model_dir: Path
) -> None:
    missing = http.post(DOWNLOADS, json={"repo_id": REPO, "gguf_file": "tiny.Q2_K.gguf"})
    assert missing.status_code == 400
    error = missing.json()["error"]
    assert error["param"] == "gguf_file" and GGUF in error["message"]
    assert "tiny.Q2_K.gguf" in error["message"]
    bad_dtype = http.post(DOWNLOADS, json={"repo_id": REPO, "gguf_file": GGUF, "dtype": "int3"})
    assert bad_dtype.status_code == 400 and "dtype" in bad_dtype.text
    not_gguf = http.post(DOWNLOADS, json={"repo_id": REPO, "gguf_file": "README.md"})
    assert not_gguf.status_code == 400 and ".gguf" in not_gguf.json()["error"]["message"]
    refused = http.post(DOWNLOADS, json={"repo_id": REPO})  # no file chosen
    assert refused.status_code == 400 and "'gguf_file'" in refused.json()["error"]["message"]
    assert leftovers(model_dir) == []


def test_an_unsupported_gguf_fails_with_the_importers_message_and_leaves_nothing(
    http: httpx.Client, model_dir: Path
) -> None:
    body = {"repo_id": BROKEN, "gguf_file": "ints.Q8_0.gguf", "name": "ints"}
    task = http.post(DOWNLOADS, json=body).json()["task"]
    failed, _ = follow(http, task["id"])
    assert failed["phase"] == "failed"
    assert "token_embd.weight has type I32, which cannot be imported" in failed["error"]
    assert "ints" not in listed(http)
    assert leftovers(model_dir) == []  # no model, no partial folder, no GGUF


def test_an_import_too_large_for_the_disk_fails_before_it_starts(
    server: Server, http: httpx.Client, hub: FakeHub, model_dir: Path
) -> None:
    # Room for the GGUF (checked before the download), not for its float32 import.
    size = len(hub.repos[REPO].files[GGUF])
    server.app.state.omlx.downloads.disk_free = lambda path: 2 * size
    body = {"repo_id": REPO, "gguf_file": GGUF, "dtype": "float32"}
    task = http.post(DOWNLOADS, json=body).json()["task"]
    failed, _ = follow(http, task["id"])
    assert failed["phase"] == "failed"
    assert "not enough disk space" in failed["error"] and "as float32" in failed["error"]
    assert "'keep'" in failed["error"]  # what to change
    assert leftovers(model_dir) == []
