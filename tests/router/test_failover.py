"""A backend that goes away: requests still succeed elsewhere (a failure before
any output is retried once), it is taken out, and it is put back when healthy."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from omlx.api.server import Server
from omlx.router.config import BackendSpec
from omlx.router.proxy import BACKEND_HEADER
from omlx.router.server import RouterServer
from tests.fixtures.prom import scrape, value
from tests.fixtures.servers import free_port, live_server
from tests.router.conftest import Fleet, start_router

MODEL = "tiny-llama"


class Spare:
    """A backend of our own to stop and start again on the same port."""

    def __init__(self, base: Path, model_dir: Path):
        self.base, self.model_dir, self.port = base, model_dir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stack: ExitStack | None = None
        self.server: Server | None = None

    def start(self) -> None:
        self._stack = ExitStack()
        self.server = self._stack.enter_context(
            live_server(self.base, self.model_dir, server={"port": self.port})
        )

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


@pytest.fixture
def spare(shared_dir: Path, tmp_path: Path) -> Iterator[Spare]:
    backend = Spare(tmp_path, shared_dir)
    backend.start()
    yield backend
    backend.stop()


def served_by(router: RouterServer, text: str) -> str:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2
    )
    assert raw.parse().choices[0].message is not None
    return raw.headers[BACKEND_HEADER]


def health_of(router: RouterServer, url: str) -> dict:
    rows = httpx.get(router.base_url + "/health").json()["backends"]
    return next(r for r in rows if r["url"] == url)


def wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_refused_connection_is_retried_once_elsewhere(fleet: Fleet, spare: Spare) -> None:
    # Polls far apart: the router still believes the spare is up when it is gone.
    router = start_router(
        [BackendSpec(spare.url), BackendSpec(fleet.a.base_url)], poll_interval_s=60
    )
    try:
        spare.stop()
        served = [served_by(router, f"Retry me elsewhere {i}.") for i in range(2)]
        assert served == [fleet.a.base_url] * 2
        samples = scrape(router.base_url)
        assert value(samples, "omlx_router_retries_total", backend=spare.url) == 1
        assert value(samples, "omlx_router_requests_routed_total", reason="retry") == 1
        row = health_of(router, spare.url)  # taken out at once, without waiting for a poll
        assert row["healthy"] is False and row["error"] == "connection refused"
    finally:
        router.stop()


def test_503_before_any_output_is_retried_elsewhere(fleet: Fleet, spare: Spare) -> None:
    router = start_router(
        [BackendSpec(spare.url), BackendSpec(fleet.a.base_url)], poll_interval_s=60
    )
    released = httpx.post(spare.url + "/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert released.status_code == 200
    try:
        # The spare answers 503 (memory released) but stays healthy: both requests
        # succeed on A, one of them after a retry.
        served = [served_by(router, f"Released elsewhere {i}.") for i in range(2)]
        assert served == [fleet.a.base_url] * 2
        assert value(scrape(router.base_url), "omlx_router_retries_total", backend=spare.url) == 1
    finally:
        router.stop()


def test_down_backend_is_taken_out_and_put_back(fleet: Fleet, spare: Spare) -> None:
    router = start_router([BackendSpec(spare.url), BackendSpec(fleet.a.base_url)])
    try:
        wait_for(lambda: health_of(router, spare.url)["healthy"])
        spare.stop()
        wait_for(lambda: not health_of(router, spare.url)["healthy"])
        assert {served_by(router, f"While it is down {i}.") for i in range(3)} == {fleet.a.base_url}
        assert value(scrape(router.base_url), "omlx_router_backend_up", backend=spare.url) == 0
        spare.start()
        wait_for(lambda: health_of(router, spare.url)["healthy"])
        served = {served_by(router, f"Back again {i}.") for i in range(4)}
        assert spare.url in served
    finally:
        router.stop()


def test_no_backend_left_answers_502_then_503(spare: Spare) -> None:
    router = start_router([BackendSpec(spare.url)], poll_interval_s=60)
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0)
    message = [{"role": "user", "content": "Anyone there?"}]
    try:
        spare.stop()
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model=MODEL, messages=message, max_tokens=2)
        assert failed.value.status_code == 502
        assert f"backend {spare.url} failed" in failed.value.message
        with pytest.raises(openai.InternalServerError) as down:  # now known to be down
            client.chat.completions.create(model=MODEL, messages=message, max_tokens=2)
        assert down.value.status_code == 503
        assert "connection refused" in down.value.message
        assert httpx.get(router.base_url + "/health").status_code == 503
    finally:
        router.stop()
