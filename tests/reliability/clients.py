"""Clients for the reliability suite: greedy requests checked against solo runs,
an RSS sampler, and the server's own view of what is still in flight."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from tests.fixtures.prom import scrape, value
from tests.fixtures.tiny_models import CORPUS

MODEL = "tiny-llama"


@dataclass(frozen=True, slots=True)
class Job:
    """One greedy request; ``chat`` picks the endpoint, ``stream`` the transport."""

    prompt: str
    max_tokens: int
    chat: bool
    stream: bool

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": self.stream,
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    finish_reason: str
    completion_tokens: int


def jobs(num: int) -> list[Job]:
    """Distinct prompts of mixed length; half share a long prefix (prefix-cache hits
    under load), every other one streams, a third are plain completions."""
    text = CORPUS.read_text(encoding="utf-8")
    shared = text[:1200]
    out = []
    for i in range(num):
        tail = text[(i * 97) % 2000 : (i * 97) % 2000 + 40 + 37 * i]
        prompt = f"{shared}\nQuestion {i}: {tail}" if i % 2 else f"Client {i} asks: {tail}"
        out.append(Job(prompt, 8 + (i * 5) % 40, chat=i % 3 != 0, stream=i % 2 == 0))
    return out


class BadAnswer(AssertionError):
    pass


def _stream_answer(lines: list[str], chat: bool) -> Answer:
    """Parse an SSE body; BadAnswer unless it is one complete, consistent stream."""
    if not lines or lines[-1] != "data: [DONE]":
        raise BadAnswer(f"stream did not end with [DONE]: {lines[-3:]}")
    ids, text, finish, usage = set(), [], None, None
    for line in lines[:-1]:
        if not line.startswith("data: "):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise BadAnswer(f"error event: {chunk['error']}")
        ids.add(chunk["id"])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            text.append((choice["delta"].get("content") or "") if chat else choice["text"])
            finish = choice.get("finish_reason") or finish
    if len(ids) != 1:
        raise BadAnswer(f"chunks of {len(ids)} different ids in one stream")
    if finish is None or usage is None:
        raise BadAnswer("stream without a finish_reason or usage")
    return Answer("".join(text), finish, usage["completion_tokens"])


def _body_answer(body: dict[str, Any], chat: bool) -> Answer:
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return Answer(text or "", choice["finish_reason"], body["usage"]["completion_tokens"])


async def ask(client: httpx.AsyncClient, job: Job) -> tuple[int, Answer | None]:
    """(HTTP status, answer); a non-200 has no answer."""
    if not job.stream:
        resp = await client.post(job.path, json=job.body())
        if resp.status_code != 200:
            return resp.status_code, None
        return 200, _body_answer(resp.json(), job.chat)
    async with client.stream("POST", job.path, json=job.body()) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, None
        lines = [line async for line in resp.aiter_lines() if line]
    return 200, _stream_answer(lines, job.chat)


@dataclass
class RssSampler:
    """RSS of a process every ``interval_s``, on a thread, until ``stop``."""

    pid: int
    interval_s: float = 0.5
    samples: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._process = psutil.Process(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._process.memory_info().rss))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window_mean(self, start_s: float, end_s: float) -> float:
        picked = [rss for t, rss in self.samples if start_s <= t <= end_s]
        assert picked, "no RSS samples in the window"
        return sum(picked) / len(picked)


def in_flight(url: str, headers: dict[str, str] | None = None) -> int:
    health = httpx.get(url + "/health", headers=headers, timeout=30).json()
    return sum(m["requests_in_flight"] for m in health["loaded_models"])


def finish_counts(url: str, model: str = MODEL) -> dict[str, int]:
    health = httpx.get(url + "/health", timeout=30).json()
    loaded = next(m for m in health["loaded_models"] if m["name"] == model)
    return dict(loaded["finished"])


def wait_idle(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> None:
    """Until no request is in flight and none waits for its first token."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = scrape(url, headers)
        if in_flight(url, headers) == 0 and value(samples, "omlx_queue_depth") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy after {timeout_s} s: {in_flight(url, headers)} in flight")


def mlx_active_bytes(url: str, headers: dict[str, str] | None = None) -> float:
    """MLX arrays alive in the server: weights plus any KV cache still held."""
    return value(scrape(url, headers), "omlx_memory_mlx_active_bytes")


def kv_returned(url: str, idle_bytes: float, timeout_s: float = 10.0) -> float:
    """Wait until MLX active memory is back to ``idle_bytes`` (1% + 1 MiB slack);
    returns the last reading. Readings are cached for up to a second, hence the wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = mlx_active_bytes(url)
        if now <= idle_bytes * 1.01 + (1 << 20) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)
