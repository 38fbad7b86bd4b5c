"""The oQ admin API (/admin/api/quant) on a live server with tiny models."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

QUANT = "/admin/api/quant"
TASK_FIELDS = {
    "id",
    "model",
    "level",
    "group_size",
    "output_name",
    "output_path",
    "phase",
    "percent",
    "elapsed_s",
    "eta_s",
    "error",
    "created_at",
    "result",
}
RUNNING = {"queued", "loading", "measuring", "quantizing", "evaluating", "saving"}


@pytest.fixture(scope="module")
def model_dir(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Copies of the tiny models: task outputs land in this dir, not the shared one."""
    root = tmp_path_factory.mktemp("quant-models")
    for name in ("tiny-llama", "slow-llama"):
        shutil.copytree(tiny_models_dir / name, root / name)
    return root


@pytest.fixture(scope="module")
def server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("quant-base"), model_dir, profiles=profiles_dir
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    # Body-less POSTs and DELETEs carry the header the admin panel sends (or they are 415).
    headers = {"X-Omlx-Client": "admin"}
    with httpx.Client(base_url=server.base_url, timeout=60, headers=headers) as client:
        yield client


def _wait(http: httpx.Client, task_id: str, phases: set[str], timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (task := http.get(f"{QUANT}/tasks/{task_id}").json())["phase"] not in phases:
        assert time.monotonic() < deadline, f"task stuck in {task['phase']}"
        time.sleep(0.1)
    return task


def test_levels(http: httpx.Client) -> None:
    levels = http.get(f"{QUANT}/levels").json()["levels"]
    by_name = {level["name"]: level["target_bits_per_weight"] for level in levels}
    assert {"oQ2", "oQ3", "oQ4", "oQ6", "oQ8"} <= set(by_name)
    assert by_name["oQ4"] == 4.5  # 16-bit scale and bias per group of 64
    assert all(set(level) == {"name", "target_bits_per_weight"} for level in levels)


def test_estimate(http: httpx.Client, model_dir: Path) -> None:
    reply = http.post(f"{QUANT}/estimate", json={"model": "tiny-llama", "level": "oQ4"})
    assert reply.status_code == 200
    body = reply.json()
    assert set(body) == {
        "model",
        "level",
        "group_size",
        "source_bytes",
        "estimated_bytes",
        "target_bits_per_weight",
        "estimated_memory_bytes",
    }
    assert body["model"] == "tiny-llama" and body["group_size"] == 64
    # float32 source: 4 bits + a 32-bit scale and bias per group of 64.
    assert body["target_bits_per_weight"] == 5.0
    weights = (model_dir / "tiny-llama" / "model.safetensors").stat().st_size
    assert weights * 0.95 < body["source_bytes"] <= weights
    assert body["estimated_bytes"] < body["source_bytes"] / 4
    assert body["estimated_memory_bytes"] > body["source_bytes"] + body["estimated_bytes"]
    smaller = http.post(
        f"{QUANT}/estimate", json={"model": "tiny-llama", "level": "oQ2", "group_size": 32}
    ).json()
    assert smaller["estimated_bytes"] < body["estimated_bytes"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": "nope", "level": "oQ4"}, 404, ["nope", "tiny-llama"]),
        ({"model": "tiny-llama", "level": "oQ7"}, 400, ["oQ2", "oQ4", "oQ8"]),
        ({"model": "tiny-llama", "level": "oQ4", "group_size": 48}, 400, ["group_size"]),
        ({"level": "oQ4"}, 400, ["model"]),
    ],
)
def test_bad_requests(http: httpx.Client, body: dict, status: int, words: list[str]) -> None:
    for path in ("/estimate", "/tasks"):
        reply = http.post(QUANT + path, json=body)
        assert reply.status_code == status, reply.text
        message = reply.json()["error"]["message"]
        assert all(w in message for w in words), message


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "..", "bad\x01name", " "])
def test_unsafe_output_names_are_refused(http: httpx.Client, name: str) -> None:
    body = {"model": "tiny-llama", "level": "oQ4", "output_name": name}
    reply = http.post(f"{QUANT}/tasks", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "output_name"


def test_existing_output_name_is_a_conflict(http: httpx.Client) -> None:
    body = {"model": "tiny-llama", "level": "oQ4", "output_name": "slow-llama"}
    reply = http.post(f"{QUANT}/tasks", json=body)
    assert reply.status_code == 409
    assert reply.json()["error"]["code"] == "output_exists"


def test_unknown_task_is_404(http: httpx.Client) -> None:
    assert http.get(f"{QUANT}/tasks/nope").status_code == 404
    assert http.post(f"{QUANT}/tasks/nope/cancel").status_code == 404
    assert http.delete(f"{QUANT}/tasks/nope").status_code == 404


def test_task_runs_while_serving_and_the_model_appears(
    http: httpx.Client, server: Server, model_dir: Path
) -> None:
    body = {"model": "slow-llama", "level": "oQ4", "output_name": "slow-oq4"}
    started = http.post(f"{QUANT}/tasks", json=body)
    assert started.status_code == 201
    task = started.json()
    assert set(task) == TASK_FIELDS
    assert task["output_path"] == str(model_dir / "slow-oq4")
    # A second task writing the same folder is refused while the first runs.
    assert http.post(f"{QUANT}/tasks", json=body).status_code == 409
    assert http.delete(f"{QUANT}/tasks/{task['id']}").status_code == 409

    _wait(http, task["id"], RUNNING - {"queued", "loading"})
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert reply.choices[0].message.content is not None
    during = http.get(f"{QUANT}/tasks/{task['id']}").json()
    assert during["phase"] in RUNNING, "the task ended before the request: nothing was overlapped"
    assert 0 < during["percent"] < 100 and during["elapsed_s"] > 0

    done = _wait(http, task["id"], {"done", "failed", "cancelled"})
    assert done["phase"] == "done", done["error"]
    assert done["result"]["bits_per_weight"] <= 5.0
    assert sum(done["result"]["bits_histogram"].values()) == done["result"]["num_layers"]
    listed = http.get(f"{QUANT}/tasks").json()["tasks"]
    assert listed[0]["id"] == task["id"]
    # Rediscovered; that it loads and generates is tests/integration/test_oq.py's job.
    assert "slow-oq4" in [m.id for m in client.models.list().data]

    assert http.delete(f"{QUANT}/tasks/{task['id']}").json() == {"deleted": task["id"]}
    assert http.get(f"{QUANT}/tasks/{task['id']}").status_code == 404
    assert (model_dir / "slow-oq4").is_dir()  # forgetting a task keeps its model


def test_cancel_removes_the_partial_folder(http: httpx.Client, model_dir: Path) -> None:
    body = {"model": "slow-llama", "level": "oQ3", "output_name": "to-cancel"}
    task = http.post(f"{QUANT}/tasks", json=body).json()
    _wait(http, task["id"], {"measuring", "done", "failed"})
    cancelled = http.post(f"{QUANT}/tasks/{task['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["phase"] == "cancelled"
    assert not (model_dir / "to-cancel").exists()
    assert not [p for p in model_dir.iterdir() if "to-cancel" in p.name]
    newest = http.get(f"{QUANT}/tasks").json()["tasks"][0]
    assert newest["id"] == task["id"] and newest["eta_s"] is None


def test_quant_routes_need_the_key(model_dir: Path, tmp_path: Path, profiles_dir: Path) -> None:
    with live_server(
        tmp_path, model_dir, server={"api_key": "sekrit"}, profiles=profiles_dir
    ) as srv:
        url = srv.base_url + QUANT + "/levels"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer sekrit"}).status_code == 200
