"""Memory control fan-out: ``release_memory_occupation`` / ``resume_memory_occupation``
sent to every backend (or the listed ones) in parallel, each within a bounded
timeout. Success only when every backend said 2xx: a backend that is down, times
out, refuses or lacks the endpoint (404/405) is reported as failed, never as done.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from omlx.errors import InvalidRequestError
from omlx.router.backends import Backend, BackendSet

DETAIL_MAX_BYTES = 500
FANOUT_PATHS = ("/release_memory_occupation", "/resume_memory_occupation")


@dataclass(frozen=True, slots=True)
class Outcome:
    backend: str
    ok: bool
    status: int | None = None
    error: str | None = None
    detail: str | None = None
    body: Any = None  # the backend's JSON answer, when it succeeded

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend}
        if self.status is not None:
            out["status"] = self.status
        if self.error is not None:
            out["error"] = self.error
        if self.ok:
            out["result"] = self.body
        else:
            out["detail"] = self.detail or ""
        return out


def split_targets(
    body: dict[str, Any], backends: BackendSet
) -> tuple[list[Backend], dict[str, Any]]:
    """The backends a fan-out goes to (``backends``: URLs, default all) and the
    body forwarded to each (the same body, without ``backends``)."""
    forwarded = {k: v for k, v in body.items() if k != "backends"}
    wanted = body.get("backends")
    if wanted is None:
        return list(backends.backends), forwarded
    if not isinstance(wanted, list) or not wanted or not all(isinstance(u, str) for u in wanted):
        raise InvalidRequestError(
            "'backends' must be a non-empty list of backend URLs", param="backends"
        )
    targets: list[Backend] = []
    unknown: list[str] = []
    for raw in wanted:
        backend = backends.get(raw.strip().rstrip("/").removesuffix("/v1"))
        if backend is None:
            unknown.append(raw)
        elif backend not in targets:
            targets.append(backend)
    if unknown:
        known = ", ".join(b.url for b in backends.backends)
        raise InvalidRequestError(
            f"'backends': {', '.join(unknown)} is not a backend of this router "
            f"(its backends: {known})",
            param="backends",
        )
    return targets, forwarded


async def fan_out(
    client: httpx.AsyncClient,
    targets: list[Backend],
    path: str,
    body: dict[str, Any],
    timeout_s: float,
) -> list[Outcome]:
    """Every target at once; each gets ``timeout_s`` in all (connect to last byte)."""
    return list(await asyncio.gather(*(_one(client, b, path, body, timeout_s) for b in targets)))


async def _one(
    client: httpx.AsyncClient, backend: Backend, path: str, body: dict[str, Any], timeout_s: float
) -> Outcome:
    try:
        async with asyncio.timeout(timeout_s):
            return await _send(client, backend, path, body)
    except TimeoutError:
        return Outcome(backend.url, False, error=f"no answer within {timeout_s:g} s")
    except httpx.ConnectError:
        return Outcome(backend.url, False, error="connection refused")
    except httpx.HTTPError as exc:
        return Outcome(backend.url, False, error=f"{type(exc).__name__}: {exc}"[:DETAIL_MAX_BYTES])


async def _send(
    client: httpx.AsyncClient, backend: Backend, path: str, body: dict[str, Any]
) -> Outcome:
    request = client.build_request(
        "POST", f"{backend.url}{path}", json=body, headers=backend.auth_headers(), timeout=None
    )
    response = await client.send(request, stream=True)
    try:
        if 200 <= response.status_code < 300:
            await response.aread()
            try:
                answer = response.json()
            except ValueError:
                answer = None
            return Outcome(backend.url, True, status=response.status_code, body=answer)
        return Outcome(
            backend.url, False, status=response.status_code, detail=await _capped_text(response)
        )
    finally:
        await response.aclose()


async def _capped_text(response: httpx.Response) -> str:
    """At most DETAIL_MAX_BYTES of the body, read no further; bytes that are not
    UTF-8 become U+FFFD rather than failing the report."""
    data = b""
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) >= DETAIL_MAX_BYTES:
            break
    text = data[:DETAIL_MAX_BYTES].decode("utf-8", errors="replace")
    while len(text.encode("utf-8")) > DETAIL_MAX_BYTES:  # U+FFFD is 3 bytes
        text = text[:-1]
    return text


def summary(outcomes: list[Outcome], path: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body): 200 when all succeeded, else 502 naming the failed."""
    failed = [o for o in outcomes if not o.ok]
    body: dict[str, Any] = {
        "total": len(outcomes),
        "failed_count": len(failed),
        "failed": [o.report() for o in failed],
        "succeeded": [o.report() for o in outcomes if o.ok],
    }
    if not failed:
        return 200, body
    names = ", ".join(o.backend for o in failed)
    body["error"] = {
        "message": f"{path.lstrip('/')} failed on {len(failed)} of {len(outcomes)} "
        f"backends: {names}",
        "type": "server_error",
        "code": "fanout_incomplete",
    }
    return 502, body
