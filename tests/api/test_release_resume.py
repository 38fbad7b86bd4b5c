"""Release and resume memory occupation against a real server: memory drops,
inference is refused with 503 + Retry-After while released, and after resume the
same greedy output comes back. A release is as narrow as it says: kv_cache keeps the
weights, one model blocks only that model, and a partial failure is reported per
model and still resumes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

ASK = {"model": "slow-llama", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("release-base"), tiny_models_dir, profiles=profiles_dir
    ) as srv:
        yield srv


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
        # Whatever a test released, serve again for the next one (a failure
        # must not leave the rest of the module released).
        client.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})


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
    assert resumed.json() == {
        "released": [],
        "released_by_model": {},
        "models_loaded": ["slow-llama"],
        "models_to_reload": [],
    }
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
    for body, param in [
        ({"tags": ["gpu"]}, "tags"),
        ({"tags": [["weights"]]}, "tags"),
        ({"tags": "weights"}, "tags"),
        ({"tags": [{"weights": 1}]}, "tags"),
        ({"tags": []}, "tags"),
        ({"model": 3}, "model"),
        ({"model": ""}, "model"),
        ({"timeout_s": "5"}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"timeout_s": 601}, "timeout_s"),
    ]:
        bad = http.post("/release_memory_occupation", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (body, bad.text)
        resume = http.post("/resume_memory_occupation", json=body)
        if param != "timeout_s":  # resume takes no timeout
            assert resume.status_code == 400 and resume.json()["error"]["param"] == param, body
    assert http.post("/release_memory_occupation", json=[1]).status_code == 400
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


def ask(http: httpx.Client, model: str, prompt: str = "Once upon a time") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return http.post("/v1/completions", json=body)


def loaded_names(http: httpx.Client) -> set[str]:
    health = {m["name"] for m in http.get("/health").json()["loaded_models"]}
    admin = {
        m["name"]
        for m in http.get("/admin/api/models").json()["models"]
        if m["state"] in {"loaded", "pinned"}
    }
    assert health == admin
    return health


def test_kv_cache_release_keeps_the_weights_loaded(server: Server, http: httpx.Client) -> None:
    # Long enough to fill a 256-token block, so the RAM cache tier holds something.
    assert ask(http, "tiny-llama", "A long shared prefix kept by the cache. " * 40).is_success
    assert server.pool.hot_cache is not None and server.pool.hot_cache.stats().hot_bytes > 0
    engine, loads = server.pool.engine("tiny-llama"), server.pool.num_loads
    released = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).json()
    assert "tiny-llama" in released["models"] and released["released"] == ["kv_cache"]
    assert "tiny-llama" in loaded_names(http)
    assert server.pool.hot_cache.stats().hot_bytes == 0
    assert ask(http, "tiny-llama").status_code == 503
    resumed = http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()
    assert resumed["models_loaded"] == []
    assert ask(http, "tiny-llama").status_code == 200
    # Served by the same engine: the weights never left.
    assert server.pool.engine("tiny-llama") is engine and server.pool.num_loads == loads


def test_release_of_one_model_blocks_only_that_model(server: Server, http: httpx.Client) -> None:
    assert ask(http, "tiny-llama").is_success and ask(http, "tiny-qwen3").is_success
    released = http.post(
        "/release_memory_occupation", json={"model": "tiny-llama", "tags": ["weights"]}
    ).json()
    assert ask(http, "tiny-qwen3").status_code == 200
    assert released["models"] == ["tiny-llama"] and released["failed"] == {}
    assert released["released_by_model"] == {"tiny-llama": ["weights"]}
    assert loaded_names(http) >= {"tiny-qwen3"} and "tiny-llama" not in loaded_names(http)
    refused = ask(http, "tiny-llama")
    assert refused.status_code == 503 and "tiny-llama" in refused.json()["error"]["message"]
    # An unscoped resume of other tags does not resume it; a scoped one does.
    assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()[
        "models_to_reload"
    ] == ["tiny-llama"]
    assert ask(http, "tiny-llama").status_code == 503
    resumed = http.post(
        "/resume_memory_occupation", json={"model": "tiny-llama", "tags": ["weights"]}
    ).json()
    assert resumed["models_loaded"] == ["tiny-llama"] and resumed["released"] == []
    assert ask(http, "tiny-llama").status_code == 200
    assert ask(http, "tiny-qwen3").status_code == 200


def test_a_release_failing_half_way_reports_each_model_and_resumes(
    server: Server, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ask(http, "tiny-llama").is_success and ask(http, "tiny-qwen3").is_success
    unload = server.pool.residents.unload

    async def unload_failing_for_qwen(name: str, **kwargs: object) -> bool:
        if name == "tiny-qwen3":
            raise RuntimeError("the MLX worker could not free tiny-qwen3")
        return await unload(name, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(server.pool.residents, "unload", unload_failing_for_qwen)
    r = http.post("/release_memory_occupation", json={"tags": ["weights"]})
    monkeypatch.undo()
    assert r.status_code == 500, r.text
    report = r.json()
    assert report["error"]["code"] == "release_incomplete"
    assert "tiny-qwen3" in report["error"]["message"]
    assert "tiny-llama" in report["models"] and "tiny-qwen3" not in report["models"]
    assert "could not free" in report["failed"]["tiny-qwen3"]
    assert "still loaded" in report["failed"]["tiny-qwen3"]
    assert server.pool.engine("tiny-llama") is None
    # Everything stays refused until resumed; resume loads back what was released.
    assert ask(http, "tiny-qwen3").status_code == 503
    resumed = http.post("/resume_memory_occupation", json={}).json()
    assert "tiny-llama" in resumed["models_loaded"] and resumed["released"] == []
    assert "tiny-qwen3" not in resumed["models_loaded"]
    assert ask(http, "tiny-llama").status_code == 200
    assert ask(http, "tiny-qwen3").status_code == 200


def test_resuming_weights_while_kv_cache_is_released_keeps_the_reload_list(
    server: Server, http: httpx.Client
) -> None:
    assert ask(http, "tiny-llama").is_success
    http.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert server.pool.engine("tiny-llama") is None
    half = http.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()
    # Still released: nothing can be served, so nothing is loaded back yet ...
    assert half["released"] == ["kv_cache"] and half["models_loaded"] == []
    assert ask(http, "tiny-llama").status_code == 503
    # ... until the rest is resumed: then the models come back and serve.
    resumed = http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()
    assert server.pool.engine("tiny-llama") is not None
    assert "tiny-llama" in resumed["models_loaded"] and resumed["models_to_reload"] == []
    assert "tiny-llama" in half["models_to_reload"]
    assert ask(http, "tiny-llama").status_code == 200
