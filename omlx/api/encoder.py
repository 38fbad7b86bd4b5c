"""What an API supplies the request pipeline (pipeline.py) to put one call on the
wire: frames to stream as engine events come, or the whole body at the end."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from omlx.api.sse import SSE_HEADERS
from omlx.engine.stream import StreamEvent
from omlx.errors import OmlxError


class Encoder(ABC):
    """One API's wire shape for one call. The defaults: server-sent events, nothing
    before the first event or after the last, no keep-alive frame."""

    media_type = "text/event-stream"

    @property
    def headers(self) -> dict[str, str]:
        return SSE_HEADERS

    def opening(self) -> list[str]:
        """Frames sent before any engine event."""
        return []

    @abstractmethod
    def frames(self, index: int, event: StreamEvent) -> list[str]:
        """Record choice ``index``'s event; the frames to stream for it."""

    @abstractmethod
    def error_frames(self, error: OmlxError) -> list[str]:
        """The frames that end a stream on an engine error."""

    def keepalive(self) -> str | None:
        """A frame for a quiet stream (None: send nothing)."""
        return None

    def closing(self) -> list[str]:
        """Frames after every choice finished."""
        return []

    @abstractmethod
    def body(self) -> dict[str, Any]:
        """The whole answer (not streamed)."""

    async def finished(self) -> None:  # noqa: B027 (a hook: most APIs need nothing here)
        """Every choice finished; runs before the last frames (or the body) go out."""

    def close(self) -> None:  # noqa: B027 (a hook: most APIs need nothing here)
        """The call is over, however it ended."""
