"""Ready at start (issue 24): the default and pinned models load in the background at
start, /health says which are loading, ready or failed, and the auto-profile is kept
between starts so an unchanged model skips its stress.

Real servers (in-process and ``omlx serve``) with real tiny models. To see a load in
progress without timing, a test queues a job that waits on an event onto the real MLX
worker before the server starts: the load queues behind it until the test lets go.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.status import ServerState, Status, readiness_from_health
from omlx.api.server import Server
from omlx.models.model_settings import ModelSettingsStore
from omlx.settings import load_settings
from tests.fixtures.servers import free_port, serve_process, share_profiles

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def one_model(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model dir holding only tiny-llama: with no default set, the model to load.
    No test changes it (a stored profile names the model's folder and files)."""
    folder = tmp_path_factory.mktemp("one-model")
    shutil.copytree(tiny_models_dir / "tiny-llama", folder / "tiny-llama")
    return folder


@contextmanager
def held_server(
    base: Path, model_dir: Path, **models: Any
) -> Iterator[tuple[Server, threading.Event]]:
    """An in-process server whose MLX worker starts blocked until the event is set."""
    settings = load_settings(
        {
            "base_path": str(base),
            "server": {"host": "127.0.0.1", "port": free_port()},
            "models": {"model_dirs": [str(model_dir)], "install_default_model": False, **models},
        }
    )
    server = Server(settings)
    release = threading.Event()
    server.worker.start()
    held = server.worker.submit(release.wait, 60)  # before the app starts: the load queues
    server.start_in_thread()
    try:
        yield server, release
        assert held.result(timeout=5) is True  # released by the test, not timed out
    finally:
        release.set()
        server.stop()


def health(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/health", timeout=10)
    assert response.status_code == 200
    return response.json()


def wait_settled(url: str, timeout_s: float = 120) -> dict[str, Any]:
    """/health once no model is loading any more."""
    deadline = time.monotonic() + timeout_s
    while (body := health(url))["models_state"] == "loading":
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    return body


def menu_line(body: dict[str, Any]) -> str:
    """The menu bar's model line for this /health body (the app's supervisor reads it)."""
    return Status(ServerState.RUNNING, models=readiness_from_health(body)).models_line()


def by_name(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in body["models"]}


def test_health_answers_while_the_model_loads_and_a_request_waits_for_that_load(
    one_model: Path, tmp_path: Path
) -> None:
    with held_server(tmp_path / "base", one_model) as (server, release):
        url = server.base_url
        loading = health(url)
        # The existing fields stay: status "ok" means the server answers.
        assert loading["status"] == "ok" and loading["version"]
        assert loading["models_state"] == "loading"
        assert loading["models"] == [{"name": "tiny-llama", "state": "loading"}]
        assert loading["loaded_models"] == []
        assert menu_line(loading) == "Loading tiny-llama…"  # what the menu bar shows
        assert httpx.get(url + "/v1/models").status_code == 200  # other routes answer
        with ThreadPoolExecutor(1) as ex:
            reply = ex.submit(
                httpx.post,
                url + "/v1/chat/completions",
                json={"model": "tiny-llama", **CHAT},
                timeout=60,
            )
            time.sleep(0.3)
            assert not reply.done()  # it waits for the load in progress
            release.set()
            assert reply.result().status_code == 200
        ready = wait_settled(url)
        assert ready["models_state"] == "ready"
        model = by_name(ready)["tiny-llama"]
        assert model["state"] == "ready" and model["kv_profile"] == "measured"
        assert menu_line(ready) == "tiny-llama ready"
        assert server.pool.num_loads == 1  # the request did not start a second load


def test_after_ready_the_first_request_loads_profiles_and_proves_nothing(
    one_model: Path, tmp_path: Path
) -> None:
    with held_server(tmp_path / "base", one_model) as (server, release):
        release.set()
        ready = by_name(wait_settled(server.base_url))["tiny-llama"]
        # Proved during the load: a proven step never runs its proof again.
        assert ready["compiled_steps"] == {"decode": "proven", "batch": "proven"}
        # What the profile measured and what it extrapolated: the widest batched prefill
        # the scheduler may run (max_concurrent_requests rows), one chunk over a long context.
        stress = ready["profile_stress"]
        assert stress["batch_rows_widest"] == 8 and 2 <= stress["batch_rows_measured"] <= 8
        assert stress["batch_extrapolated"] == (stress["batch_rows_measured"] < 8)
        assert stress["long_context_tokens"] >= 512 and stress["long_context_peak_bytes"] > 0
        # The CPU backend runs its measured fast paths (a GPU would run the plain path).
        assert ready["execution_strategy"]["name"] == "fast_paths"
        pool = server.pool
        engine = pool.engine("tiny-llama")
        assert engine is not None
        loads, measured = pool.num_loads, pool.profile_cache.num_measured
        reply = httpx.post(
            server.base_url + "/v1/chat/completions",
            json={"model": "tiny-llama", **CHAT},
            timeout=60,
        )
        assert reply.status_code == 200
        assert pool.engine("tiny-llama") is engine
        assert (pool.num_loads, pool.profile_cache.num_measured) == (loads, measured) == (1, 1)


def _start_and_settle(base: Path, model_dir: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """``omlx serve``: /health once settled, and the server's log."""
    with serve_process(base, model_dir, *flags) as (proc, url):
        body = wait_settled(url)
        proc.send_signal(2)
        _, log = proc.communicate(timeout=60)
    return body, log


@pytest.fixture(scope="module")
def first_start(one_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The base of a first ``omlx serve`` start, which measured tiny-llama's profile, and
    its /health once settled. Tests restart on a copy of it (the same model folder)."""
    base = tmp_path_factory.mktemp("first-start") / "base"
    body, _ = _start_and_settle(base, one_model)
    return base, body


def restarted_base(first_start: tuple[Path, dict], tmp_path: Path) -> Path:
    """A copy of the first start's base, for a test to restart on."""
    base = tmp_path / "base"
    shutil.copytree(first_start[0], base)
    return base


def test_a_second_start_reuses_the_profile_and_a_changed_limit_measures_again(
    one_model: Path, first_start: tuple[Path, dict], tmp_path: Path
) -> None:
    first = first_start[1]
    assert by_name(first)["tiny-llama"]["kv_profile"] == "measured"
    stored = list((first_start[0] / "profiles").glob("*.json"))
    assert len(stored) == 1 and stored[0].stat().st_mode & 0o077 == 0  # private

    base = restarted_base(first_start, tmp_path)
    second, log = _start_and_settle(base, one_model)
    assert by_name(second)["tiny-llama"]["kv_profile"] == "reused"
    # Every measured field came back from the stored profile.
    stress = by_name(first)["tiny-llama"]["profile_stress"]
    assert by_name(second)["tiny-llama"]["profile_stress"] == stress
    assert stress["long_context_tokens"] > 0
    assert "reused the auto-profile of tiny-llama" in log

    third, log = _start_and_settle(base, one_model, "--max-process-memory", "6GB")
    assert by_name(third)["tiny-llama"]["kv_profile"] == "measured"
    assert "measuring" in log and "changed limits" in log


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        # Well-formed, but the profile is not one: never trusted.
        None,
    ],
    ids=["corrupt", "malformed-profile"],
)
def test_a_damaged_profile_file_is_ignored_and_measured_again(
    one_model: Path, first_start: tuple[Path, dict], tmp_path: Path, content: str | None
) -> None:
    base = restarted_base(first_start, tmp_path)
    (path,) = (base / "profiles").glob("*.json")
    if content is None:
        entry = json.loads(path.read_text())
        entry["profile"]["max_kv_tokens"] = -5
        content = json.dumps(entry)
    path.write_text(content)
    body, log = _start_and_settle(base, one_model)
    assert by_name(body)["tiny-llama"]["kv_profile"] == "measured"
    assert "ignoring the stored profile" in log
    assert json.loads(path.read_text())["profile"]["max_kv_tokens"] > 0  # rewritten whole
    again, _ = _start_and_settle(base, one_model)
    assert by_name(again)["tiny-llama"]["kv_profile"] == "reused"


def test_pinned_models_and_the_default_load_at_start_and_nothing_else(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    base = tmp_path / "base"
    share_profiles(base, profiles_dir)  # what is measured is not this test's question
    ModelSettingsStore(base / "model_settings.json").put("tiny-qwen3", {"pinned": True})
    with held_server(base, tiny_models_dir, default_model="tiny-llama") as (server, release):
        assert health(server.base_url)["models_state"] == "loading"
        release.set()
        body = wait_settled(server.base_url)
    assert body["models_state"] == "ready"
    assert {n: m["state"] for n, m in by_name(body).items()} == {
        "tiny-qwen3": "ready",
        "tiny-llama": "ready",
    }
    assert sorted(m["name"] for m in body["loaded_models"]) == ["tiny-llama", "tiny-qwen3"]


def test_several_models_and_no_default_load_nothing_at_start(
    tiny_models_dir: Path, tmp_path: Path
) -> None:
    with held_server(tmp_path / "base", tiny_models_dir) as (server, release):
        release.set()
        body = health(server.base_url)
        assert body["models_state"] == "ready" and body["models"] == []
        assert server.pool.num_loads == 0


def test_load_at_start_off_loads_nothing(one_model: Path, tmp_path: Path) -> None:
    with held_server(tmp_path / "base", one_model, load_at_start=False) as (server, release):
        release.set()
        time.sleep(0.3)
        assert health(server.base_url)["models"] == [] and server.pool.num_loads == 0


def test_a_model_that_cannot_load_is_reported_failed_with_the_reason(
    tiny_models_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    shutil.copytree(tiny_models_dir / "tiny-llama", models / "broken")
    for weights in (models / "broken").glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with held_server(tmp_path / "base", models) as (server, release):
        release.set()
        body = wait_settled(server.base_url)
    assert body["status"] == "ok"  # the server keeps serving
    assert body["models_state"] == "failed"
    broken = by_name(body)["broken"]
    assert broken["state"] == "failed" and broken["reason"]


def test_a_default_model_that_does_not_exist_fails_naming_what_exists(
    one_model: Path, tmp_path: Path
) -> None:
    with held_server(tmp_path / "base", one_model, default_model="nope") as (server, release):
        release.set()
        body = wait_settled(server.base_url)
    failed = by_name(body)["nope"]
    assert failed["state"] == "failed"
    assert "nope" in failed["reason"] and "tiny-llama" in failed["reason"]
