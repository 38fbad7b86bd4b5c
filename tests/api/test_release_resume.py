"""Release and resume memory occupation against a real server: memory drops,
inference is refused with 503 + Retry-After while released, and after resume the
same greedy output comes back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

ASK = {"model": "slow-llama", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with live_server(tmp_path_factory.mktemp("release-base"), tiny_models_dir) as srv:
        yield srv


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def mlx_active(server: Server) -> int:
    """MLX's active bytes now, read on the MLX thread (the only one that may)."""
    reading = server.worker.submit(lambda: server.pool.probe.reading(fresh=True)).result()
    return reading.mlx_active_bytes


def test_release_and_resume(server: Server, http: httpx.Client) -> None:
    before = http.post("/v1/completions", json=ASK).json()["choices"][0]["text"]
    loaded = mlx_active(server)
    released = http.post(
        "/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}
    ).json()
    assert released["models"] == ["slow-llama"]
    # slow-llama holds ~128 MB of float32 weights; MLX gives them back.
    assert loaded - mlx_active(server) > 100_000_000
    refused = http.post("/v1/completions", json=ASK)
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) > 0
    assert "resume" in refused.json()["error"]["message"]
    resumed = http.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert resumed.json() == {"released": [], "models_loaded": ["slow-llama"]}
    after = http.post("/v1/completions", json=ASK).json()["choices"][0]["text"]
    assert after == before


def test_admin_paths_and_bad_requests(http: httpx.Client) -> None:
    r = http.post("/admin/api/memory/release", json={"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.json()["released"] == ["kv_cache"]
    assert http.post("/v1/completions", json=ASK).status_code == 503
    assert http.post("/admin/api/memory/resume", json={"tags": ["kv_cache"]}).status_code == 200
    assert http.post("/v1/completions", json=ASK).status_code == 200
    stage = http.post("/release_memory_occupation", json={"stage_to_cpu": True})
    assert stage.status_code == 400 and "unified memory" in stage.json()["error"]["message"]
    bad = http.post("/release_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
    # Nothing was released by the refused calls.
    assert http.post("/v1/completions", json=ASK).status_code == 200


def test_release_waits_for_in_flight_then_ends_them(server: Server, http: httpx.Client) -> None:
    import threading

    results: dict[str, httpx.Response] = {}

    def long_request() -> None:
        body = {**ASK, "max_tokens": 2000, "ignore_eos": True}
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            results["r"] = client.post("/v1/completions", json=body)

    worker = threading.Thread(target=long_request)
    worker.start()
    engine = None
    while engine is None or not engine.num_in_flight:
        engine = server.pool.engine("slow-llama")
    released = http.post("/release_memory_occupation", json={"timeout_s": 0.2}).json()
    worker.join(60)
    assert released["requests_ended"] == 1
    assert results["r"].status_code == 503
    assert "released" in results["r"].json()["error"]["message"]
    http.post("/resume_memory_occupation", json={})
