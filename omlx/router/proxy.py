"""Forwarding one inference request: pick a backend, send, pass the answer
through chunk by chunk (no buffering), retry once elsewhere if it failed before
any output, and close the upstream request when the client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from omlx.errors import BadGatewayError, InvalidRequestError, ServiceUnavailableError
from omlx.router.affinity import AffinityTable, block_hashes
from omlx.router.backends import Backend, BackendSet
from omlx.router.config import RouterConfig
from omlx.router.picker import Choice, choose
from omlx.router.sessions import ResponseOwners, noting_response_id

log = logging.getLogger(__name__)

# Answers that mean "not now, here" (the backend is restarting, out of memory or
# its own upstream failed): worth one try elsewhere while nothing was sent yet.
RETRY_STATUSES = frozenset({502, 503, 504})
BACKEND_HEADER = "x-omlx-backend"
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}
)
# The router's own credentials stay here; the backend's key is added per backend. The
# router's origin guard has vetted the request: the backend's would see a foreign origin.
_NOT_FORWARDED = _HOP_BY_HOP | {
    "host", "content-length", "authorization", "x-api-key", "cookie", "origin", "referer",
    "sec-fetch-site", "sec-fetch-mode", "sec-fetch-dest", "sec-fetch-user",
}  # fmt: skip
_DISCONNECT_POLL_S = 0.25
_T = TypeVar("_T")


@dataclass(slots=True)
class Failure:
    """A try that produced no output: why, and the backend's answer if it gave one."""

    backend: Backend
    reason: str
    status: int | None = None
    body: bytes = b""
    headers: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class _Route:
    model: str | None
    hashes: list[bytes]
    pinned: str | None  # the backend holding the previous response, if known


@dataclass(slots=True)
class Opened:
    backend: Backend
    upstream: httpx.Response
    first_chunk: bytes
    chunks: AsyncIterator[bytes]


@dataclass(slots=True)
class RouteStats:
    """Requests routed, per (backend, reason); retries per backend that failed."""

    routed: Counter[tuple[str, str]]
    retried: Counter[str]

    @classmethod
    def empty(cls) -> RouteStats:
        return cls(Counter(), Counter())


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        backends: BackendSet,
        affinity: AffinityTable,
        client: httpx.AsyncClient,
    ):
        self.config = config
        self.backends = backends
        self.affinity = affinity
        self.client = client
        self.stats = RouteStats.empty()
        self.response_owners = ResponseOwners()

    async def forward(self, request: Request) -> Response:
        raw = await request.body()
        body = _json_object(raw)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        hashes = block_hashes(body, self.config.affinity_block_chars)
        pinned = self.response_owners.get(body.get("previous_response_id"))
        opened = await _unless_disconnected(
            request, self._open_with_retry(request, raw, _Route(model, hashes, pinned))
        )
        if opened is None:  # the client left before any answer: nobody reads this
            return Response(status_code=499)
        if isinstance(opened, Failure):
            return _failure_response(opened)
        return self._relay(opened, note_response_id=request.url.path == "/v1/responses")

    async def forward_stored(self, request: Request, response_id: str) -> Response:
        """A stored response's routes go to the backend that made it; when the
        router does not know it (e.g. after a restart), to each backend in turn
        until one has it."""
        owner = self.response_owners.get(response_id)
        order = sorted(self.backends.healthy(), key=lambda b: b.url != owner)
        if not order:
            raise ServiceUnavailableError("no healthy backend", retry_after_s=2)
        for backend in order[:-1]:
            result = await self._try(backend, request, b"")
            if isinstance(result, Opened):
                if result.upstream.status_code != 404:
                    return self._relay(result, note_response_id=False)
                await result.upstream.aclose()  # not there: ask the next one
                backend.num_in_flight -= 1
        last = await self._try(order[-1], request, b"")  # its answer, even a 404, is final
        if isinstance(last, Failure):
            return _failure_response(last)
        return self._relay(last, note_response_id=False)

    async def _open_with_retry(
        self, request: Request, raw: bytes, route: _Route
    ) -> Opened | Failure:
        """The first try that gives output; a failure before output is retried
        once on another backend (the last failure is returned if both fail)."""
        tried: set[str] = set()
        failure: Failure | None = None
        for _ in range(2):
            try:
                choice = self._choose(route, tried)
            except ServiceUnavailableError:
                if failure is None:
                    raise
                return failure  # nowhere else to go: the client gets the failure
            result = await self._try(choice.backend, request, raw)
            if isinstance(result, Opened):
                self._count(choice, retried_from=failure)
                if result.upstream.status_code < 400:
                    self.affinity.record(route.hashes, choice.backend.url)
                return result
            failure = result
            tried.add(choice.backend.url)
            log.warning("backend %s failed before output (%s)", choice.backend.url, failure.reason)
        assert failure is not None
        return failure

    def _choose(self, route: _Route, tried: set[str]) -> Choice:
        return choose(
            self.backends,
            self.affinity,
            route.model,
            route.hashes,
            self.config.affinity_max_extra_load,
            exclude=tried,
            pinned=route.pinned,
        )

    def _count(self, choice: Choice, retried_from: Failure | None) -> None:
        choice.backend.num_routed += 1
        choice.backend.last_routed_at = time.monotonic()
        reason = "retry" if retried_from is not None else choice.reason
        self.stats.routed[(choice.backend.url, reason)] += 1
        if retried_from is not None:
            self.stats.retried[retried_from.backend.url] += 1

    async def _try(self, backend: Backend, request: Request, raw: bytes) -> Opened | Failure:
        """Send to ``backend`` and read up to its first body chunk."""
        url = f"{backend.url}{request.url.path}"
        outgoing = self.client.build_request(
            request.method,
            url,
            params=str(request.query_params),
            headers={**_forwarded_headers(request), **backend.auth_headers()},
            content=raw,
        )
        backend.num_in_flight += 1
        upstream: httpx.Response | None = None
        try:
            upstream = await self.client.send(outgoing, stream=True)
            if upstream.status_code in RETRY_STATUSES:
                return await _failed_answer(backend, upstream)
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")
        except httpx.TransportError as exc:
            backend.num_in_flight -= 1
            if upstream is not None:
                await upstream.aclose()
            if isinstance(exc, httpx.ConnectError):
                self.backends.mark_down(backend, "connection refused")
            return Failure(
                backend, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            )
        except BaseException:  # cancelled (the client left) or a bug: close upstream
            backend.num_in_flight -= 1
            if upstream is not None:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
            raise
        return Opened(backend, upstream, first, chunks)

    def _relay(self, opened: Opened, note_response_id: bool) -> Response:
        backend = opened.backend

        async def chunks() -> AsyncIterator[bytes]:
            try:
                if opened.first_chunk:
                    yield opened.first_chunk
                async for chunk in opened.chunks:
                    yield chunk
            except httpx.TransportError as exc:  # mid-stream: the client sees it end early
                log.warning("backend %s broke off a response: %r", backend.url, exc)

        body = chunks()
        if note_response_id and opened.upstream.status_code < 400:
            body = noting_response_id(body, self.response_owners, backend.url)
        headers = {k: v for k, v in opened.upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers[BACKEND_HEADER] = backend.url
        return _RelayedResponse(opened, body, headers)


class _RelayedResponse(StreamingResponse):
    """Closes the upstream response however the relay ends (done, failed, or the
    client gone, even before the first chunk): the backend then sees the client
    gone and aborts the generation."""

    def __init__(self, opened: Opened, content: AsyncIterator[bytes], headers: dict[str, str]):
        super().__init__(content, status_code=opened.upstream.status_code, headers=headers)
        self._opened = opened

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._opened.upstream.aclose()
            self._opened.backend.num_in_flight -= 1


async def _failed_answer(backend: Backend, upstream: httpx.Response) -> Failure:
    """A retryable status: keep its body (bounded) in case no retry is possible."""
    try:
        body = await _read_capped(upstream, 64 * 1024)
    except httpx.TransportError:
        body = b""
    finally:
        backend.num_in_flight -= 1
        await upstream.aclose()
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
    if upstream.status_code == 503:
        backend.cooling_until = time.monotonic() + _retry_after_s(upstream.headers)
    headers.pop("content-length", None)
    headers.pop("content-encoding", None)
    return Failure(backend, f"answered {upstream.status_code}", upstream.status_code, body, headers)


async def _read_capped(upstream: httpx.Response, limit: int) -> bytes:
    data = b""
    async for chunk in upstream.aiter_bytes():
        data += chunk
        if len(data) >= limit:
            break
    return data[:limit]


def _retry_after_s(headers: httpx.Headers) -> float:
    """The backend's Retry-After in seconds (1..30; 2 when absent or a date)."""
    try:
        return min(30.0, max(1.0, float(headers.get("retry-after", "2"))))
    except ValueError:
        return 2.0


def _failure_response(failure: Failure) -> Response:
    if failure.status is not None:
        headers = {**(failure.headers or {}), BACKEND_HEADER: failure.backend.url}
        return Response(failure.body, status_code=failure.status, headers=headers)
    raise BadGatewayError(f"backend {failure.backend.url} failed: {failure.reason}")


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError("request body is not valid JSON") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return body


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """Await ``work``, cancelling it (None) if the client disconnects first: a
    non-streamed answer sends nothing until it is done."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()
