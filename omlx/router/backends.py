"""The backends: each one's health, load and models, polled every few seconds.

A backend is *healthy* while ``/health`` answers and ``/v1/models`` accepts the
router's key for it. Load comes from its Prometheus ``/metrics``
(``omlx_requests_in_flight``, ``omlx_queue_depth``, memory gauges) and from the
router's own count of requests it has in flight there (fresher than a poll).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from omlx.router.config import BackendSpec, RouterConfig

log = logging.getLogger(__name__)

# Polls are small GETs: a backend slower than this is as good as down.
POLL_TIMEOUT_S = 5.0


@dataclass(slots=True)
class Load:
    """What a backend's /metrics said at the last poll."""

    requests_in_flight: int = 0
    queue_depth: int = 0
    memory_used_bytes: int = 0
    memory_soft_limit_bytes: int = 0
    admission_paused: bool = False

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.memory_soft_limit_bytes - self.memory_used_bytes)

    @property
    def memory_pressed(self) -> bool:
        """Admission paused, or under 10% of the soft limit left: new work there
        would wait or be throttled while other backends have room."""
        low = self.headroom_bytes < self.memory_soft_limit_bytes // 10
        return self.admission_paused or (self.memory_soft_limit_bytes > 0 and low)


@dataclass(slots=True)
class Backend:
    spec: BackendSpec
    healthy: bool = False
    error: str | None = "not polled yet"
    models: list[dict[str, Any]] = field(default_factory=list)  # /v1/models "data" entries
    load: Load = field(default_factory=Load)
    num_in_flight: int = 0  # proxied by the router right now
    num_routed: int = 0
    last_routed_at: float = 0.0  # monotonic
    # After a 503 with Retry-After the backend is skipped until then (if others can serve).
    cooling_until: float = 0.0  # monotonic
    num_failed_polls: int = 0
    checked_at: float = 0.0

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def model_ids(self) -> set[str]:
        return {m["id"] for m in self.models if isinstance(m.get("id"), str)}

    @property
    def busy(self) -> int:
        """Requests in flight: the router's own count, or the backend's if it has
        more (other clients, or the router's requests since the last poll)."""
        return max(self.num_in_flight, self.load.requests_in_flight)

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.spec.key}"} if self.spec.key else {}


def parse_load(text: str) -> Load:
    """Sum the per-model gauges of an omlx ``/metrics`` page into one ``Load``."""
    load = Load()
    for family in text_string_to_metric_families(text):
        total = int(sum(s.value for s in family.samples))
        if family.name == "omlx_requests_in_flight":
            load.requests_in_flight = total
        elif family.name == "omlx_queue_depth":
            load.queue_depth = total
        elif family.name == "omlx_memory_used_bytes":
            load.memory_used_bytes = total
        elif family.name == "omlx_memory_soft_limit_bytes":
            load.memory_soft_limit_bytes = total
        elif family.name == "omlx_memory_admission_paused":
            load.admission_paused = total > 0
    return load


class BackendSet:
    """Every backend and the loop that polls them."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient):
        self.config = config
        self.backends = [Backend(spec) for spec in config.backends]
        self._client = client

    def get(self, url: str) -> Backend | None:
        return next((b for b in self.backends if b.url == url), None)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            await self.poll_all()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(b) for b in self.backends))

    async def poll(self, backend: Backend) -> None:
        try:
            models, load = await self._read(backend)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._poll_failed(backend, _describe(exc))
            return
        backend.models, backend.load = models, load
        backend.num_failed_polls, backend.error = 0, None
        backend.checked_at = time.monotonic()
        if not backend.healthy:
            log.info("backend %s is healthy (%d models)", backend.url, len(models))
        backend.healthy = True

    async def _read(self, backend: Backend) -> tuple[list[dict[str, Any]], Load]:
        headers = backend.auth_headers()
        get = self._client.get
        health, models, metrics = await asyncio.gather(
            get(f"{backend.url}/health", timeout=POLL_TIMEOUT_S),
            get(f"{backend.url}/v1/models", headers=headers, timeout=POLL_TIMEOUT_S),
            get(f"{backend.url}/metrics", headers=headers, timeout=POLL_TIMEOUT_S),
        )
        for response in (health, models):
            if response.status_code != 200:
                raise httpx.HTTPStatusError(
                    f"{response.request.url.path} answered {response.status_code}"
                    + (
                        " (the backend refused the router's key)"
                        if response.status_code == 401
                        else ""
                    ),
                    request=response.request,
                    response=response,
                )
        # An older omlx without /metrics still routes, by the router's own counts.
        load = parse_load(metrics.text) if metrics.status_code == 200 else Load()
        return list(models.json()["data"]), load

    def _poll_failed(self, backend: Backend, reason: str) -> None:
        backend.num_failed_polls += 1
        backend.error = reason
        backend.checked_at = time.monotonic()
        if backend.healthy and backend.num_failed_polls >= self.config.unhealthy_after:
            self.mark_down(backend, reason)

    def mark_down(self, backend: Backend, reason: str) -> None:
        """Take a backend out until a poll finds it healthy again."""
        if backend.healthy:
            log.warning("backend %s taken out: %s", backend.url, reason)
        backend.healthy = False
        backend.error = reason


def _describe(exc: Exception) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in {POLL_TIMEOUT_S:g} s"
    return str(exc) or type(exc).__name__
