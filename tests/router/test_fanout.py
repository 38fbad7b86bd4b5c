"""Memory release/resume fanned out to every backend: 200 only when all did it;
otherwise 502 naming each backend that did not (down, refusing, no endpoint, slow)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from omlx.router.config import BackendSpec
from omlx.router.fanout import DETAIL_MAX_BYTES
from omlx.router.server import RouterServer
from tests.fixtures.servers import free_port
from tests.router.conftest import C_KEY, ROUTER_KEY, Fleet, start_router

AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}
KV = {"tags": ["kv_cache"]}


def post(
    router: RouterServer, path: str, body: dict, headers: dict | None = None
) -> httpx.Response:
    return httpx.post(router.base_url + path, json=body, headers=headers or {}, timeout=60)


def test_all_up_release_and_resume_answer_200(fleet: Fleet) -> None:
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        reply = post(fleet.router, path, KV, AUTH)
        assert reply.status_code == 200, reply.text
        report = reply.json()
        assert report["total"] == 3 and report["failed_count"] == 0
        assert {o["backend"] for o in report["succeeded"]} == set(fleet.backends)
    # Released and resumed: every backend serves again.
    for url in fleet.backends:
        assert httpx.get(url + "/health").json()["status"] == "ok"


def test_backends_list_targets_some(fleet: Fleet) -> None:
    reply = post(
        fleet.router, "/release_memory_occupation", {**KV, "backends": [fleet.a.base_url]}, AUTH
    )
    assert reply.status_code == 200, reply.text
    assert [o["backend"] for o in reply.json()["succeeded"]] == [fleet.a.base_url]
    post(fleet.router, "/resume_memory_occupation", {**KV, "backends": [fleet.a.base_url]}, AUTH)
    unknown = post(
        fleet.router, "/release_memory_occupation", {"backends": ["http://nowhere:1"]}, AUTH
    )
    assert unknown.status_code == 400
    assert "http://nowhere:1" in unknown.json()["error"]["message"]


def test_one_backend_down_answers_502_naming_it(fleet: Fleet) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = start_router([BackendSpec(fleet.a.base_url), BackendSpec(dead)])
    try:
        reply = post(router, "/release_memory_occupation", KV)
        assert reply.status_code == 502
        report = reply.json()
        assert report["total"] == 2 and report["failed_count"] == 1
        assert report["failed"] == [{"backend": dead, "error": "connection refused", "detail": ""}]
        assert [o["backend"] for o in report["succeeded"]] == [fleet.a.base_url]
    finally:
        post(router, "/resume_memory_occupation", KV)
        router.stop()


def test_a_backend_refusing_the_key_is_a_failure_with_its_answer(fleet: Fleet) -> None:
    router = start_router(
        [BackendSpec(fleet.a.base_url), BackendSpec(fleet.c.base_url, "not-" + C_KEY)]
    )
    try:
        reply = post(router, "/release_memory_occupation", KV)
        assert reply.status_code == 502
        (failed,) = reply.json()["failed"]
        assert failed["backend"] == fleet.c.base_url and failed["status"] == 401
        assert "authentication_error" in failed["detail"]  # the backend's own answer
    finally:
        post(router, "/resume_memory_occupation", KV)
        router.stop()


class _OldServer(BaseHTTPRequestHandler):
    """A server without the endpoint (404 with a long, partly binary page), or a
    slow one (answers after 3 s)."""

    def do_POST(self) -> None:
        if self.server.slow:  # type: ignore[attr-defined]
            time.sleep(3)
        body = b"no such route \xff\xfe " + "é".encode() * 1000
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def old_server(slow: bool = False) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OldServer)
    server.slow = slow  # type: ignore[attr-defined]
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_missing_endpoint_is_a_failure_with_capped_detail(fleet: Fleet) -> None:
    with old_server() as old:
        router = start_router([BackendSpec(fleet.a.base_url), BackendSpec(old)])
        try:
            reply = post(router, "/resume_memory_occupation", KV)
        finally:
            router.stop()
    assert reply.status_code == 502
    (failed,) = reply.json()["failed"]
    assert failed["backend"] == old and failed["status"] == 404
    # Bytes that are not UTF-8 become U+FFFD; a character cut at the cap is dropped.
    assert failed["detail"].startswith("no such route \ufffd\ufffd éé")
    assert DETAIL_MAX_BYTES - 2 <= len(failed["detail"].encode()) <= DETAIL_MAX_BYTES


def test_a_slow_backend_times_out_without_holding_the_others(fleet: Fleet) -> None:
    with old_server(slow=True) as slow:
        router = start_router(
            [BackendSpec(fleet.a.base_url), BackendSpec(slow)], fanout_timeout_s=0.5
        )
        try:
            started = time.monotonic()
            reply = post(router, "/resume_memory_occupation", KV)
            elapsed = time.monotonic() - started
        finally:
            router.stop()
    assert reply.status_code == 502
    assert reply.json()["failed"] == [
        {"backend": slow, "error": "no answer within 0.5 s", "detail": ""}
    ]
    assert elapsed < 2.5
