"""Drive engine requests from a route: submit, merge streams, watch the client."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request as HttpRequest

from omlx.api.metrics import GenerationObserver
from omlx.engine.model_engine import ModelEngine
from omlx.engine.stream import RequestStream, StreamEvent
from omlx.scheduler import Request

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Generation:
    """The requests of one HTTP call (several for a list of prompts)."""

    engine: ModelEngine
    requests: list[Request]
    streams: list[RequestStream] = field(default_factory=list)
    start_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    observer: GenerationObserver | None = None
    # Streams get the engine's admission notice (see RequestStream).
    wants_admission: bool = False

    def submit(self) -> None:
        loop = asyncio.get_running_loop()
        streams = [
            RequestStream(r.request_id, loop, wants_admission=self.wants_admission)
            for r in self.requests
        ]
        # All or none, in one step: a prompt's choices share its prefill.
        self.engine.submit_together(list(zip(self.requests, streams, strict=True)))
        self.streams = streams
        if self.observer is not None:
            self.observer.started(self.engine.name, len(self.streams))

    def abort_unfinished(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    async def events(
        self, keepalive_s: float
    ) -> AsyncGenerator[tuple[int, StreamEvent] | None, None]:
        """(choice index, event) as they come; None when ``keepalive_s`` passed quietly."""
        queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            while True:
                event = await stream.get()
                assert event is not None
                queue.put_nowait((index, event))
                if event.finished:
                    return

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        remaining = len(tasks)
        try:
            while remaining:
                try:
                    index, event = await asyncio.wait_for(queue.get(), keepalive_s)
                except TimeoutError:
                    yield None
                    continue
                if self.first_token_s is None and event.num_output_tokens:
                    self.first_token_s = time.perf_counter()
                remaining -= event.finished
                if self.observer is not None:
                    self.observer.event(index, event)
                yield index, event
        finally:
            for task in tasks:
                task.cancel()
            if self.observer is not None:
                self.observer.close()

    async def collect(self, on_event: Callable[[int, StreamEvent], object]) -> None:
        """Hand every event to ``on_event`` until all requests finish (a whole,
        non-streamed answer); an error event aborts the rest and is raised."""
        async with aclosing(self.events(keepalive_s=3600.0)) as events:
            async for item in events:
                if item is None:
                    continue
                index, event = item
                if event.error is not None:
                    self.abort_unfinished()
                    raise event.error
                on_event(index, event)

    def log_done(self, kind: str, prompt: int, output: int, reasons: list[str]) -> None:
        total = time.perf_counter() - self.start_s
        ttft = (self.first_token_s or time.perf_counter()) - self.start_s
        log.info(
            "%s model=%s prompt=%d output=%d finish=%s ttft=%.3fs total=%.3fs",
            kind,
            self.engine.name,
            prompt,
            output,
            ",".join(reasons),
            ttft,
            total,
        )


async def until_disconnect(http_request: HttpRequest) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def unless_disconnected(
    http_request: HttpRequest, work: Awaitable[T], on_gone: Callable[[], None]
) -> T:
    """Await ``work``; if the client disconnects first, call ``on_gone`` and raise."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(http_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    on_gone()
    raise ClientGone
