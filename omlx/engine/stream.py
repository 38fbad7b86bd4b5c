"""Per-request output streams: the MLX thread produces, the event loop consumes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from omlx.engine.token_text import LogprobEntry
from omlx.errors import OmlxError


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """A delta of generated text; the last event of a request has finish_reason."""

    text: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    # The stop string that ended the request (None: end of sequence, length, ...).
    stop_string: str | None = None
    error: OmlxError | None = None
    # The admission notice (no text): the request started and its prefix lookup is
    # done, so num_prompt_tokens and num_cached_tokens are final from here on.
    admitted: bool = False
    # Prompt tokens this request writes to the prefix cache beyond the cached ones.
    num_cache_written_tokens: int = 0
    # The logprobs of this delta's tokens (requests that asked for them).
    logprobs: tuple[LogprobEntry, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """Events for one request, bound to the event loop that awaits them.

    When the producer is ahead, ``get`` merges everything queued into one event.
    ``wants_admission``: the engine also sends the admission notice (an event with
    ``admitted`` and no text) before the prefill; other streams never see one.
    """

    def __init__(
        self, request_id: str, loop: asyncio.AbstractEventLoop, *, wants_admission: bool = False
    ):
        self.request_id = request_id
        self.loop = loop
        self.wants_admission = wants_admission
        self._events: list[StreamEvent] = []
        self._ready = asyncio.Event()
        self.finished = False

    def push(self, event: StreamEvent) -> None:
        """Event-loop side: append an event and wake the reader."""
        self._events.append(event)
        self._ready.set()

    async def get(self, timeout_s: float | None = None) -> StreamEvent | None:
        """Next (merged) event, or None if ``timeout_s`` passed with nothing new."""
        if not self._events:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except TimeoutError:
                return None
        events, self._events = self._events, []
        self._ready.clear()
        merged = _merge(events)
        self.finished = merged.finished
        return merged


def _merge(events: Sequence[StreamEvent]) -> StreamEvent:
    if len(events) == 1:
        return events[0]
    last = events[-1]
    return StreamEvent(
        text="".join(e.text for e in events),
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        finish_reason=last.finish_reason,
        stop_string=last.stop_string,
        error=next((e.error for e in events if e.error is not None), None),
        admitted=any(e.admitted for e in events),
        num_cache_written_tokens=max(e.num_cache_written_tokens for e in events),
        logprobs=tuple(entry for e in events for entry in e.logprobs),
    )


def deliver(batch: Sequence[tuple[RequestStream, StreamEvent]]) -> None:
    """Push a step's events; runs on the event loop (one wake-up per step)."""
    for stream, event in batch:
        stream.push(event)
