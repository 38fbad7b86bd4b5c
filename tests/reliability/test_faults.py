"""Faults: clients that vanish mid-request, and a disk that fills up under the cache.

(SIGKILL during cache writes is tests/integration/test_cache_faults.py, which
carries the ``reliability`` marker too.)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.fixtures.servers import aborted_count, live_server, serve_process, wait_aborted
from tests.fixtures.tiny_models import CORPUS
from tests.reliability.clients import kv_returned, mlx_active_bytes, wait_idle
from tests.reliability.conftest import Profile

MODEL = "tiny-llama"
# Seconds of decoding even alone, minutes in a batch: no request can finish
# before its client leaves, so every one must end as an abort.
LONG_MAX_TOKENS = 4000


def _long_body(i: int, stream: bool, chat: bool) -> dict:
    body: dict = {
        "model": MODEL,
        "max_tokens": LONG_MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell story number {i}."}]
    else:
        body["prompt"] = f"Story number {i}:"
    return body


async def _hang_up(client: httpx.AsyncClient, body: dict) -> None:
    """Send a whole request on a raw connection and close it before any answer."""
    url = client.base_url
    raw = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    _, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(head.encode() + raw)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def _leave(client: httpx.AsyncClient, i: int) -> str:
    """Start a request that would run for a long time and go away early: after the
    first token of a stream, after a chat stream's first event (maybe still
    queued), right after sending (no answer read at all), or by giving up waiting
    for a plain JSON answer."""
    kind = ("stream", "chat-stream", "stream", "hang-up", "give-up")[i % 5]
    if kind == "give-up":
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                "/v1/completions",
                json=_long_body(i, False, False),
                timeout=httpx.Timeout(60, read=0.5),
            )
        return kind
    if kind == "hang-up":
        await _hang_up(client, _long_body(i, i % 2 == 0, False))
        return kind
    chat = kind == "chat-stream"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", path, json=_long_body(i, True, chat)) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and (chat or json.loads(line[6:])["choices"][0]["text"]):
                break  # leaving the block drops the connection mid-stream
    return kind


async def _storm(url: str, num: int, concurrency: int) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(i: int) -> str:
            async with gate:
                return await _leave(client, i)

        return await asyncio.gather(*(one(i) for i in range(num)))


def test_clients_leaving_mid_request_abort_it_and_free_everything(
    tiny_models_dir: Path, tmp_path: Path, profile: Profile, profiles_dir: Path
) -> None:
    greedy = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    with live_server(
        tmp_path, tiny_models_dir, scheduler={"max_concurrent_requests": 16}, profiles=profiles_dir
    ) as srv:
        url = srv.base_url
        before = httpx.post(url + "/v1/completions", json=greedy, timeout=120).json()
        wait_idle(url)
        idle_mlx_bytes = mlx_active_bytes(url)

        kinds = asyncio.run(_storm(url, profile.disconnects, concurrency=16))

        assert len(kinds) == profile.disconnects and set(kinds) == {
            "stream",
            "chat-stream",
            "hang-up",
            "give-up",
        }
        # Every one of them was aborted: none ran on to its last token.
        wait_aborted(srv, MODEL, profile.disconnects, timeout_s=60)
        wait_idle(url)
        assert kv_returned(url, idle_mlx_bytes) <= idle_mlx_bytes * 1.01 + (1 << 20)
        after = httpx.post(url + "/v1/completions", json=greedy, timeout=120).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert aborted_count(srv, MODEL) == profile.disconnects


# -- full disk ------------------------------------------------------------------

DISK_BYTES = 2 << 20


@contextmanager
def tiny_disk(path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at ``path`` (needs root, as in CI); skips where mounting is refused."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _prompts() -> list[str]:
    # ~1,000 tokens each: together several times what the disk holds as KV blocks.
    text = CORPUS.read_text(encoding="utf-8")
    return [f"Document {i}.\n" + text[i * 50 : i * 50 + 4000] for i in range(8)]


def _complete(url: str, prompt: str) -> tuple[int, str, int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    if resp.status_code != 200:
        return resp.status_code, resp.text, 0
    out = resp.json()
    return 200, out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _ssd_stats(url: str) -> dict:
    """The SSD tier's counters once its writer has drained its queue."""
    for _ in range(200):
        stats = httpx.get(url + "/admin/api/cache/stats", timeout=30).json()
        ssd = stats["models"][MODEL]["ssd"]
        if ssd["pending_writes"] == 0:
            return ssd
        time.sleep(0.05)
    raise AssertionError(f"SSD writes still pending: {ssd}")


def test_a_full_disk_under_the_cache_does_not_stop_serving(
    tiny_models_dir: Path, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    # Write-through and small blocks: every prompt writes many files at once. The
    # budget is far above the disk, so the writes really hit ENOSPC.
    cache = {"hot_cache_mode": "write-through", "block_size": 16, "ssd_cache_max_size": "1GB"}
    (base / "settings.json").write_text(json.dumps({"cache": cache}))
    prompts = _prompts()
    log = tmp_path / "server.log"
    with (
        tiny_disk(tmp_path / "disk") as disk,
        log.open("w") as err,
        serve_process(base, tiny_models_dir, "--cache-dir", str(disk), stderr=err) as (_, url),
        ThreadPoolExecutor(4) as pool,
    ):
        cold = list(pool.map(lambda p: _complete(url, p), prompts))
        assert [status for status, _, _ in cold] == [200] * len(prompts)
        wait_idle(url)
        full = _ssd_stats(url)
        # Repeats are served (from the RAM tier) with the same greedy text.
        warm = list(pool.map(lambda p: _complete(url, p), prompts))
        assert [(s, t) for s, t, _ in warm] == [(s, t) for s, t, _ in cold]
        assert all(cached > 0 for _, _, cached in warm)
        # Clearing the SSD tier makes room; writes succeed again.
        cleared = httpx.post(url + "/admin/api/cache/clear", json={"tier": "ssd"}, timeout=30)
        assert cleared.status_code == 200
        assert _complete(url, "A new prompt after the clear. " * 30)[0] == 200
        wait_idle(url)
        after_clear = _ssd_stats(url)
    assert full["errors"] > 0, "the disk never filled up: the test proved nothing"
    assert "disk full" in log.read_text()
    assert after_clear["saves_persisted"] > full["saves_persisted"]
    assert "Traceback" not in log.read_text()
