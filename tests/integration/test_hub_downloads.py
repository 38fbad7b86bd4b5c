"""Hub downloads end to end: the real huggingface_hub client against a local fake Hub,
a live omlx server, and the real `omlx pull` CLI in a child process.

A tiny real MLX model is served by the fake Hub in two safetensors shards, so an
interrupted download has a finished first shard a resumed one must not fetch again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from omlx.api.server import Server
from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.servers import ROOT, free_port, live_server
from tests.fixtures.tiny_models import build_tiny_model

REPO = "mlx-community/tiny-llama-4bit"
DOWNLOADS = "/admin/api/models/downloads"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
TASK_FIELDS = {
    "id",
    "repo_id",
    "revision",
    "name",
    "phase",
    "bytes_done",
    "bytes_total",
    "speed_bps",
    "eta_s",
    "error",
    "fit",
    "created_at",
    "finished_at",
    "gguf_file",
    "dtype",
    "result",
}
FINISHED = {"done", "failed", "cancelled"}
# Slow enough that a shard takes seconds: a test can stop the download between shards.
SLOW_BPS = 120_000


def build_sharded_model(folder: Path) -> Path:
    """A tiny llama whose weights are split over two shards plus the index, as the
    Hub's larger MLX repos are."""
    import mlx.core as mx

    build_tiny_model(folder, "llama", seed=3)
    weights = mx.load(str(folder / "model.safetensors"))
    names = sorted(weights)
    half = {SHARD1: names[: len(names) // 2], SHARD2: names[len(names) // 2 :]}
    for shard, keys in half.items():
        mx.save_safetensors(str(folder / shard), {k: weights[k] for k in keys})
    (folder / "model.safetensors").unlink()
    weight_map = {k: shard for shard, keys in half.items() for k in keys}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    model = build_sharded_model(tmp_path_factory.mktemp("hub-src") / "tiny")
    with FakeHub() as fake:
        fake.add_folder(REPO, model, downloads=900, likes=7)
        fake.add_folder("mlx-community/tiny-llama-8bit", model, downloads=50)
        fake.add_folder("someone/gated-llama", model, gated=True)
        fake.add_folder("someone/private-llama", model, private=True)
        fake.add_repo(
            "someone/torch-only",
            {"config.json": b'{"model_type": "llama"}', "pytorch_model.bin": b"\0" * 64},
        )
        fake.add_repo(
            "someone/bert-mlx",
            {"config.json": b'{"model_type": "bert_like"}', "model.safetensors": b"\0" * 64},
        )
        fake.add_repo(
            "someone/tiny-GGUF",
            {"tiny.Q4_K_M.gguf": b"GGUF" * 100, "tiny.Q8_0.gguf": b"GGUF" * 200, "README.md": b"#"},
            tags=["gguf"],
        )
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
    headers = {"X-Omlx-Client": "admin"}
    with httpx.Client(base_url=server.base_url, timeout=60, headers=headers) as client:
        yield client


def wait_phase(http: httpx.Client, task_id: str, phases: set[str], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while (task := http.get(f"{DOWNLOADS}/{task_id}").json())["phase"] not in phases:
        assert time.monotonic() < deadline, f"download stuck in {task['phase']}: {task}"
        time.sleep(0.05)
    return task


def wait_for_file(path: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def listed_models(http: httpx.Client) -> set[str]:
    return {m["id"] for m in http.get("/v1/models").json()["data"]}


def chat(http: httpx.Client, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def repo_bytes(hub: FakeHub, repo: str = REPO) -> int:
    return sum(len(data) for data in hub.repos[repo].files.values())


def pull(base: Path, model_dir: Path, hub: FakeHub, *args: str, **popen: Any) -> Any:
    """`omlx pull` as a real child process talking to the fake Hub through HF_ENDPOINT.
    Started with Ctrl-C's default handling, as a terminal starts it: a child inherits
    an ignored SIGINT, and the test session's may be (a full run's was: the pull then
    ran to the end through the test's Ctrl-C)."""
    start = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('omlx.cli', run_name='__main__', alter_sys=True)"
    )
    cmd = [sys.executable, "-c", start, "--base-path", str(base), "pull", *args]
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "OMLX_MODELS__MODEL_DIRS": json.dumps([str(model_dir)]),
    }
    env.pop("HF_TOKEN", None)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, **popen)


# -- pulled through the admin API and the CLI, then served --------------------------


def test_inspect_reads_files_sizes_and_fit_before_downloading(
    http: httpx.Client, hub: FakeHub
) -> None:
    hub.clear_log()
    reply = http.post(f"{DOWNLOADS}/inspect", json={"repo_id": REPO})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {
        "repo_id",
        "revision",
        "kind",
        "files",
        "total_bytes",
        "gguf_files",
        "fit",
        "disk_free_bytes",
    }
    assert (body["kind"], body["revision"], body["gguf_files"]) == ("mlx", "main", [])
    sizes = {f["name"]: f["size"] for f in body["files"]}
    assert sizes[SHARD1] == len(hub.repos[REPO].files[SHARD1])
    assert body["total_bytes"] == sum(sizes.values()) == repo_bytes(hub)
    assert body["fit"]["verdict"] == "fits"
    assert body["disk_free_bytes"] > 0
    # Nothing but the small config was fetched: no weights before a download is asked for.
    fetched = {
        s.path.rsplit("/", 1)[-1] for s in hub.log if s.method == "GET" and "/resolve/" in s.path
    }
    assert fetched <= {"config.json"}


def test_admin_download_then_cli_pull_both_served(
    http: httpx.Client, hub: FakeHub, model_dir: Path, tmp_path: Path
) -> None:
    reply = http.post(DOWNLOADS, json={"repo_id": REPO})
    assert reply.status_code == 201, reply.text
    task = reply.json()["task"]
    assert set(task) == TASK_FIELDS
    assert (task["name"], task["bytes_total"]) == ("tiny-llama-4bit", repo_bytes(hub))
    assert (task["gguf_file"], task["dtype"], task["result"]) == (None, None, None)
    done = wait_phase(http, task["id"], FINISHED)
    assert done["phase"] == "done", done
    assert done["bytes_done"] == done["bytes_total"] and done["finished_at"] is not None
    assert "tiny-llama-4bit" in listed_models(http)
    assert chat(http, "tiny-llama-4bit")
    assert http.get(DOWNLOADS).json()["downloads"][0]["id"] == task["id"]
    assert http.delete(f"{DOWNLOADS}/{task['id']}").status_code == 204
    assert http.get(f"{DOWNLOADS}/{task['id']}").status_code == 404

    # The CLI writes into the same model dir the running server reads.
    proc = pull(
        tmp_path / "cli-base",
        model_dir,
        hub,
        REPO,
        "--name",
        "from-cli",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "memory: fits" in out and "MB/s" in err
    assert "from-cli" in listed_models(http)
    assert chat(http, "from-cli")


def test_cancel_leaves_nothing_listed_and_next_download_resumes(
    http: httpx.Client, hub: FakeHub, model_dir: Path
) -> None:
    hub.bytes_per_s = SLOW_BPS
    task = http.post(DOWNLOADS, json={"repo_id": REPO, "name": "resumed"}).json()["task"]
    partial = model_dir / ".resumed.download-partial"
    wait_for_file(partial / SHARD1)  # the first shard finished, the second in flight
    running = http.get(f"{DOWNLOADS}/{task['id']}").json()
    assert running["phase"] == "downloading" and 0 < running["bytes_done"] < running["bytes_total"]
    assert http.delete(f"{DOWNLOADS}/{task['id']}").status_code == 409
    cancelled = http.post(f"{DOWNLOADS}/{task['id']}/cancel").json()
    assert cancelled["phase"] == "cancelled"
    assert "resumed" not in listed_models(http)
    assert not (model_dir / "resumed").exists() and partial.is_dir()

    hub.bytes_per_s = None
    hub.clear_log()
    again = http.post(DOWNLOADS, json={"repo_id": REPO, "name": "resumed"}).json()["task"]
    assert wait_phase(http, again["id"], FINISHED)["phase"] == "done"
    assert hub.file_bytes_served(REPO, SHARD1) == 0  # kept from the cancelled run
    assert 0 < hub.file_bytes_served(REPO) < repo_bytes(hub)
    assert "resumed" in listed_models(http) and not partial.exists()


def test_ctrl_c_of_cli_pull_keeps_a_hidden_partial_the_next_pull_resumes(
    hub: FakeHub, model_dir: Path, tmp_path: Path
) -> None:
    hub.bytes_per_s = SLOW_BPS
    proc = pull(
        tmp_path / "base", model_dir, hub, REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    partial = model_dir / ".tiny-llama-4bit.download-partial"
    wait_for_file(partial / SHARD1)
    proc.send_signal(signal.SIGINT)  # to the CLI alone, as a test cannot press Ctrl-C
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "resume" in err and "Traceback" not in err
    assert [p.name for p in model_dir.iterdir()] == [
        partial.name
    ]  # nothing that looks like a model
    # The worker child stopped too: the partial folder no longer grows.
    size = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file())
    time.sleep(1.0)
    assert sum(p.stat().st_size for p in partial.rglob("*") if p.is_file()) == size

    hub.bytes_per_s = None
    hub.clear_log()
    proc = pull(
        tmp_path / "base", model_dir, hub, REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert hub.file_bytes_served(REPO, SHARD1) == 0
    assert 0 < hub.file_bytes_served(REPO) < repo_bytes(hub)
    assert (model_dir / "tiny-llama-4bit" / SHARD2).is_file() and not partial.exists()


def download_workers(partial: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "omlx.models.download_worker" in cmdline and str(partial) in cmdline:
            found.append(proc)
    return found


def test_a_killed_pull_takes_its_worker_with_it(
    hub: FakeHub, model_dir: Path, tmp_path: Path
) -> None:
    hub.bytes_per_s = SLOW_BPS
    proc = pull(tmp_path / "base", model_dir, hub, REPO, stderr=subprocess.DEVNULL)
    partial = model_dir / ".tiny-llama-4bit.download-partial"
    wait_for_file(partial / SHARD1)
    workers = download_workers(partial)
    assert len(workers) == 1
    proc.kill()  # no chance to stop its child: the child notices by itself
    proc.wait(timeout=10)
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive and gone
    hub.bytes_per_s = None


# -- refusals, each before a byte of weights moves --------------------------------------


def error_of(reply: httpx.Response) -> Any:
    return reply.json()["error"]


def test_bad_requests_are_refused_with_the_reason(http: httpx.Client, model_dir: Path) -> None:
    unknown = http.post(DOWNLOADS, json={"repo_id": "nobody/no-such-model"})
    assert unknown.status_code == 404 and "nobody/no-such-model" in error_of(unknown)["message"]
    gated = http.post(DOWNLOADS, json={"repo_id": "someone/gated-llama"})
    assert gated.status_code == 401 and "models.hf_token" in error_of(gated)["message"]
    assert "HF_TOKEN" in error_of(gated)["message"]
    private = http.post(f"{DOWNLOADS}/inspect", json={"repo_id": "someone/private-llama"})
    assert private.status_code == 401 and "models.hf_token" in error_of(private)["message"]
    for name in ("../escape", ".hidden", "a/b", " padded "):
        unsafe = http.post(DOWNLOADS, json={"repo_id": REPO, "name": name})
        assert unsafe.status_code == 400, name
        assert error_of(unsafe)["param"] == "name"
    torch = http.post(DOWNLOADS, json={"repo_id": "someone/torch-only"})
    assert torch.status_code == 400 and "safetensors" in error_of(torch)["message"]
    bert = http.post(DOWNLOADS, json={"repo_id": "someone/bert-mlx"})
    assert bert.status_code == 400 and "bert_like" in error_of(bert)["message"]
    bad_id = http.post(DOWNLOADS, json={"repo_id": "not a repo id!"})
    assert bad_id.status_code == 400
    typo = http.post(DOWNLOADS, json={"repo": REPO})
    assert typo.status_code == 400 and "repo_id" in error_of(typo)["message"]
    (model_dir / "taken").mkdir()
    taken = http.post(DOWNLOADS, json={"repo_id": REPO, "name": "taken"})
    assert taken.status_code == 409 and "omlx models rm" in error_of(taken)["message"]
    assert not any(p.name.startswith(".") for p in model_dir.iterdir())  # nothing started


def test_gated_repo_with_a_token(hub: FakeHub, model_dir: Path, tmp_path: Path) -> None:
    for token, status in (("hf_wrong", 403), ("hf_good_token", 200)):
        models = {"hf_endpoint": hub.url, "hf_token": token}
        with live_server(tmp_path / token, model_dir, models=models) as srv:
            reply = httpx.post(
                srv.base_url + f"{DOWNLOADS}/inspect", json={"repo_id": "someone/gated-llama"}
            )
            assert reply.status_code == status, reply.text
            settings = httpx.get(srv.base_url + "/admin/api/settings").json()["settings"]
            assert settings["models"]["hf_token"] == "***"  # never shown


def test_gguf_only_repo_offers_its_gguf_files(http: httpx.Client) -> None:
    body = http.post(f"{DOWNLOADS}/inspect", json={"repo_id": "someone/tiny-GGUF"}).json()
    assert body["kind"] == "gguf" and body["fit"] is None
    assert {f["name"] for f in body["gguf_files"]} == {"tiny.Q4_K_M.gguf", "tiny.Q8_0.gguf"}
    refused = http.post(DOWNLOADS, json={"repo_id": "someone/tiny-GGUF"})
    assert refused.status_code == 400
    assert "tiny.Q4_K_M.gguf" in error_of(refused)["message"]
    assert "'gguf_file'" in error_of(refused)["message"]  # how to ask for one
    assert "--gguf" in error_of(refused)["message"]


def test_disk_short_is_507(server: Server, http: httpx.Client, hub: FakeHub) -> None:
    manager = server.app.state.omlx.downloads
    real = manager.disk_free
    manager.disk_free = lambda path: min(real(path), repo_bytes(hub) - 1)
    reply = http.post(DOWNLOADS, json={"repo_id": REPO})
    assert reply.status_code == 507, reply.text
    error = error_of(reply)
    assert error["needed_bytes"] == repo_bytes(hub) and error["free_bytes"] == repo_bytes(hub) - 1
    assert "disk space" in error["message"]


def test_hub_unreachable_is_502_with_the_words(model_dir: Path, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with live_server(tmp_path / "base", model_dir, models={"hf_endpoint": dead}) as srv:
        for path, body in (
            (DOWNLOADS, {"repo_id": REPO}),
            (f"{DOWNLOADS}/inspect", {"repo_id": REPO}),
        ):
            reply = httpx.post(srv.base_url + path, json=body)
            assert reply.status_code == 502
            assert "Hub unreachable: offline? set models.hf_endpoint (a mirror)" in reply.text
        search = httpx.get(srv.base_url + "/admin/api/hub/search", params={"q": "x"})
        assert search.status_code == 502


def test_hf_endpoint_cannot_be_redirected_over_http_without_the_key(http: httpx.Client) -> None:
    reply = http.put("/admin/api/settings", json={"models": {"hf_endpoint": "http://evil.example"}})
    assert reply.status_code == 403 and "models.hf_endpoint" in reply.text


# -- search ------------------------------------------------------------------------


def test_search_lists_mlx_models_by_downloads_with_size_quantization_fit(
    http: httpx.Client, hub: FakeHub
) -> None:
    reply = http.get("/admin/api/hub/search", params={"q": "tiny", "limit": 5})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["repo_id"] for r in results] == [
        REPO,
        "mlx-community/tiny-llama-8bit",
    ]  # no GGUF repo
    first = results[0]
    assert set(first) == {"repo_id", "downloads", "likes", "size_bytes", "quantization", "fit"}
    assert (first["downloads"], first["likes"], first["quantization"]) == (900, 7, "4bit")
    weights = sum(len(d) for n, d in hub.repos[REPO].files.items() if n.endswith(".safetensors"))
    assert 0.9 * weights < first["size_bytes"] <= weights  # the files less their headers
    assert first["fit"]["verdict"] == "fits"
    assert results[1]["quantization"] == "8bit"
    assert http.get("/admin/api/hub/search", params={"limit": 0}).status_code == 400


# -- restarts ------------------------------------------------------------------------


def test_restart_resumes_an_unfinished_download_or_says_why_not(
    hub: FakeHub, model_dir: Path, tmp_path: Path
) -> None:
    base, models = tmp_path / "base", {"hf_endpoint": hub.url}
    hub.bytes_per_s = SLOW_BPS
    with live_server(base, model_dir, models=models) as srv:
        for name in ("comes-back", "blocked"):
            reply = httpx.post(srv.base_url + DOWNLOADS, json={"repo_id": REPO, "name": name})
            assert reply.status_code == 201
        wait_for_file(model_dir / ".comes-back.download-partial" / SHARD1)
    saved = json.loads((base / "downloads.json").read_text())["downloads"]
    assert {t["name"]: t["phase"] for t in saved} == {
        "comes-back": "downloading",
        "blocked": "downloading",
    }
    (model_dir / "blocked").mkdir()  # the name got taken while omlx was stopped

    hub.bytes_per_s = None
    hub.clear_log()
    with live_server(base, model_dir, models=models) as srv:
        client = httpx.Client(base_url=srv.base_url, timeout=60)
        tasks = {t["name"]: t for t in client.get(DOWNLOADS).json()["downloads"]}
        assert tasks["blocked"]["phase"] == "failed"
        assert "appeared" in tasks["blocked"]["error"] and "blocked" in tasks["blocked"]["error"]
        resumed = wait_phase(client, tasks["comes-back"]["id"], FINISHED)
        assert resumed["phase"] == "done", resumed
        assert hub.file_bytes_served(REPO, SHARD1) == 0
        assert "comes-back" in listed_models(client)
