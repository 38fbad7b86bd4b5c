"""Backend choice (pure): affinity, its limit under load, least loaded, cooling, pinning."""

from __future__ import annotations

import time

import httpx
import pytest

from omlx.errors import ServiceUnavailableError
from omlx.router.affinity import AffinityTable, block_hashes
from omlx.router.backends import Backend, BackendSet, Load
from omlx.router.config import BackendSpec, RouterConfig
from omlx.router.picker import choose

URLS = ("http://a:1", "http://b:1", "http://c:1")
BODY = {"model": "m", "messages": [{"role": "user", "content": "p" * 2000}]}


def backend_set(models: dict[str, set[str]] | None = None) -> BackendSet:
    config = RouterConfig(backends=tuple(BackendSpec(u) for u in URLS))
    backends = BackendSet(config, httpx.AsyncClient())
    for backend in backends.backends:
        backend.healthy = True
        names = (models or {}).get(backend.url, {"m"})
        backend.models = [{"id": n} for n in names]
    return backends


def pick(
    backends: BackendSet, table: AffinityTable, body: dict = BODY, pinned: str | None = None
) -> tuple[str, str]:
    choice = choose(backends, table, body["model"], block_hashes(body, 512), 4, pinned=pinned)
    return choice.backend.url, choice.reason


def at(backends: BackendSet, url: str) -> Backend:
    backend = backends.get(url)
    assert backend is not None
    return backend


def test_affinity_wins_until_its_backend_is_much_busier() -> None:
    backends, table = backend_set(), AffinityTable(100)
    table.record(block_hashes(BODY, 512), "http://b:1")
    assert pick(backends, table) == ("http://b:1", "affinity")
    at(backends, "http://b:1").num_in_flight = 4
    assert pick(backends, table) == ("http://b:1", "affinity")
    at(backends, "http://b:1").num_in_flight = 5
    assert pick(backends, table)[1] == "least_loaded"


def test_least_loaded_reads_the_backends_own_count_and_memory() -> None:
    backends, table = backend_set(), AffinityTable(100)
    a, b, c = backends.backends
    a.load = Load(requests_in_flight=3)
    b.load = Load(admission_paused=True)
    assert pick(backends, table) == ("http://c:1", "least_loaded")
    c.num_in_flight = 5
    assert pick(backends, table)[0] == "http://a:1"


def test_only_backends_with_the_model_and_ollama_names() -> None:
    backends = backend_set({"http://c:1": {"m", "only-c"}})
    body = {"model": "only-c:latest", "prompt": "x"}
    assert pick(backends, AffinityTable(10), body)[0] == "http://c:1"
    at(backends, "http://c:1").healthy = False
    with pytest.raises(ServiceUnavailableError, match="no backend can serve 'only-c:latest'"):
        pick(backends, AffinityTable(10), body)


def test_a_cooling_backend_is_skipped_while_others_serve() -> None:
    backends = backend_set()
    for backend in backends.backends[:2]:
        backend.cooling_until = time.monotonic() + 30
    assert pick(backends, AffinityTable(10))[0] == "http://c:1"
    backends.backends[2].cooling_until = time.monotonic() + 30
    assert pick(backends, AffinityTable(10))[0] in URLS  # all cooling: still served


def test_pinned_backend_first_unless_it_cannot_serve() -> None:
    backends = backend_set()
    assert pick(backends, AffinityTable(10), pinned="http://c:1") == ("http://c:1", "pinned")
    at(backends, "http://c:1").healthy = False
    assert pick(backends, AffinityTable(10), pinned="http://c:1")[1] == "least_loaded"
