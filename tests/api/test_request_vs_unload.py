"""Every request ends, whatever runs beside it: a release or an unload that lands
while a request awaits its grammar compile (after the route fetched the engine,
before it is submitted), or while its model is still loading, answers the
request (drained like one in flight) or fails it with a retryable 503. Never a
hang. The window is held open by waiting on an Event inside the route's own
grammar step or the pool's own model load, so the race is forced, not lucky."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import omlx.api.pipeline as pipeline
import omlx.engine.building as building_module
from omlx.api.server import Server
from tests.fixtures.servers import live_server

JSON_ASK = {
    "model": "tiny-llama",
    "prompt": "Once upon a time",
    "max_tokens": 8,
    "temperature": 0,
    "response_format": {"type": "json_object"},
}
MESSAGE_ASK = {
    "model": "tiny-llama",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "Say hi."}],
    "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
}
# A request that does not end within this bound counts as hung (generous: the
# machine may be busy, and a load takes seconds there).
BOUND_S = 30.0
TEST = {"X-Omlx-Client": "test"}


@pytest.fixture(scope="module")
def server(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with live_server(tmp_path_factory.mktemp("unload-race"), tiny_models_dir) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=120, headers=TEST) as client:
            assert client.post("/admin/api/models/tiny-llama/load", json={}).is_success
        yield srv


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=BOUND_S, headers=TEST) as client:
        yield client
        # Whatever a test released, serve again for the next one.
        client.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})


class Gate:
    """Holds a step of the server open until the test lets it go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        # Bounded, so a broken test cannot wedge the server's threads for good.
        self.opened.wait(BOUND_S)

    def wait_entered(self) -> None:
        assert self.entered.wait(BOUND_S), "the request never reached the held step"


@pytest.fixture
def held_grammar(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """The route's grammar compile waits for the gate (a slow compile, on demand)."""
    gate, compile_grammar = Gate(), pipeline.bind_grammar

    async def slow_bind_grammar(engine: Any, spec: Any, pool: Any) -> Any:
        await asyncio.to_thread(gate.hold)
        return await compile_grammar(engine, spec, pool)

    # Every API binds its grammar in the pipeline.
    monkeypatch.setattr(pipeline, "bind_grammar", slow_bind_grammar)
    return gate


@pytest.fixture
def held_load(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """The pool's model load (on the MLX thread) waits for the gate (a slow load)."""
    gate, load_model = Gate(), building_module.load_model

    def slow_load_model(info: Any) -> Any:
        gate.hold()
        return load_model(info)

    monkeypatch.setattr(building_module, "load_model", slow_load_model)
    return gate


def in_background(server: Server, path: str, body: dict[str, Any]) -> Callable[[], httpx.Response]:
    """POST in a thread; the returned function joins it and gives the response
    (or raises what the client raised, e.g. a read timeout: a hung request)."""
    out: dict[str, Any] = {}

    def send() -> None:
        try:
            with httpx.Client(base_url=server.base_url, timeout=BOUND_S, headers=TEST) as c:
                out["response"] = c.post(path, json=body)
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=send)
    thread.start()

    def result() -> httpx.Response:
        thread.join(BOUND_S + 10)
        if "error" in out:
            raise out["error"]
        return out["response"]

    return result


def wait_until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        time.sleep(0.01)


def assert_retryable_503(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) > 0
    message = response.json()["error"]["message"]
    assert all(word in message for word in words), message


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", JSON_ASK), ("/v1/messages", MESSAGE_ASK)]
)
def test_release_while_a_request_compiles_its_grammar_fails_it_with_503(
    server: Server, http: httpx.Client, held_grammar: Gate, path: str, body: dict[str, Any]
) -> None:
    request = in_background(server, path, body)
    held_grammar.wait_entered()
    released = http.post(
        "/release_memory_occupation", json={"tags": ["weights"], "timeout_s": 0.2}
    ).json()
    assert "tiny-llama" in released["models"]
    assert server.pool.engine("tiny-llama") is None
    held_grammar.opened.set()
    assert_retryable_503(request(), "released")


def test_release_drains_a_request_still_compiling_its_grammar(
    server: Server, http: httpx.Client, held_grammar: Gate
) -> None:
    request = in_background(server, "/v1/completions", JSON_ASK)
    held_grammar.wait_entered()
    release = in_background(
        server, "/release_memory_occupation", {"tags": ["weights"], "timeout_s": BOUND_S}
    )
    wait_until(lambda: bool(server.pool.released))
    held_grammar.opened.set()
    # Accepted before the release, so it is served like a request in flight ...
    answered = request()
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["finish_reason"] in {"stop", "length"}
    # ... and the release waited for it, then freed the model.
    released = release().json()
    assert "tiny-llama" in released["models"] and released["requests_ended"] == 0
    assert server.pool.engine("tiny-llama") is None


def test_admin_unload_while_a_request_compiles_its_grammar_fails_it_with_503(
    server: Server, http: httpx.Client, held_grammar: Gate
) -> None:
    assert http.post("/admin/api/models/tiny-llama/load", json={}).is_success
    request = in_background(server, "/v1/completions", JSON_ASK)
    held_grammar.wait_entered()
    unloaded = http.post("/admin/api/models/tiny-llama/unload", json={"drain_s": 0})
    assert unloaded.json()["unloaded"] is True
    held_grammar.opened.set()
    assert_retryable_503(request(), "tiny-llama", "unloaded")
    # The next request loads the model again and is served.
    assert http.post("/v1/completions", json=JSON_ASK).status_code == 200


def test_a_load_in_progress_during_a_release_is_released_too(
    server: Server, http: httpx.Client, held_load: Gate
) -> None:
    http.post("/admin/api/models/tiny-qwen3/unload", json={})
    request = in_background(server, "/v1/completions", {**JSON_ASK, "model": "tiny-qwen3"})
    held_load.wait_entered()
    release = in_background(
        server, "/release_memory_occupation", {"tags": ["weights"], "timeout_s": 0}
    )
    wait_until(lambda: bool(server.pool.released))
    held_load.opened.set()
    released = release().json()
    # The release waited for the load and reports the model it then unloaded ...
    assert "tiny-qwen3" in released["models"]
    assert server.pool.model_state("tiny-qwen3") == "unloaded"
    # ... and the caller of that load is told memory was released, not served.
    assert_retryable_503(request(), "released")
    resumed = http.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()
    assert "tiny-qwen3" in resumed["models_loaded"]
