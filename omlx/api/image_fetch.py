"""Fetch the http(s) image URLs a request names, from allowed hosts only.

Off by default (``models.image_url_allowlist`` empty): a server fetching what a
request names would fetch on a web page's behalf. Each fetch is bounded in time
and bytes and does not follow redirects (one could leave the allowed hosts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
from urllib.parse import urlsplit

import httpx

from omlx.api.images import MAX_IMAGE_BYTES, ImagePart, ImageSink
from omlx.errors import InvalidRequestError

FETCH_TIMEOUT_S = 10.0


def host_allowed(url: str, allowlist: tuple[str, ...]) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return any(fnmatch.fnmatchcase(host, glob.lower()) for glob in allowlist)


async def fetch_images(sink: ImageSink) -> None:
    """Replace each URL part of ``sink`` by the image's bytes (400 naming the part)."""
    pending = [i for i, part in enumerate(sink.parts) if part.url is not None]
    if not pending:
        return
    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False) as client:
        fetched = await asyncio.gather(
            *(_fetch(client, sink.parts[i], sink.url_allowlist) for i in pending)
        )
    for i, part in zip(pending, fetched, strict=True):
        sink.parts[i] = part


async def _fetch(
    client: httpx.AsyncClient, part: ImagePart, allowlist: tuple[str, ...]
) -> ImagePart:
    assert part.url is not None
    where = part.where
    if not host_allowed(part.url, allowlist):
        raise InvalidRequestError(
            f"{where}: this server fetches image URLs only from hosts in "
            "models.image_url_allowlist (empty: none); send the image inline as a data URL "
            "(data:image/png;base64,...)",
            param=where,
        )
    try:
        async with asyncio.timeout(FETCH_TIMEOUT_S):
            data = await _read_bounded(client, part.url, where)
    except (TimeoutError, httpx.HTTPError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError | httpx.TimeoutException) else exc
        raise InvalidRequestError(
            f"{where}: the image could not be fetched ({reason})", param=where
        ) from None
    return dataclasses.replace(part, data=data, url=None)


async def _read_bounded(client: httpx.AsyncClient, url: str, where: str) -> bytes:
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise InvalidRequestError(
                f"{where}: fetching the image answered HTTP {response.status_code}", param=where
            )
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > MAX_IMAGE_BYTES:
                raise InvalidRequestError(
                    f"{where}: the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB; "
                    "send a smaller image",
                    param=where,
                )
            chunks.append(chunk)
    return b"".join(chunks)
