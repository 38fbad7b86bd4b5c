"""What the shell shows: the server's state as one immutable snapshot."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ServerState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    NOT_RESPONDING = "not responding"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class PortOffer:
    """Another omlx already answers on the configured port; the user may use it."""

    port: int
    version: str


@dataclass(frozen=True, slots=True)
class Status:
    state: ServerState = ServerState.STOPPED
    port: int | None = None
    pid: int | None = None
    # True when the server is another omlx we attached to (we neither started nor stop it).
    adopted: bool = False
    num_restarts: int = 0
    reason: str = ""  # why ERROR / NOT_RESPONDING
    message: str = ""  # a notice worth showing once: restarted, port changed, ...
    offer: PortOffer | None = None
    exit_code: int | None = None  # of our last server process, once it ended

    def headline(self) -> str:
        """The menu's status line."""
        where = f" on :{self.port}" if self.port else ""
        if self.state is ServerState.RUNNING:
            owner = " (external)" if self.adopted else ""
            return f"Running{where}{owner}"
        if self.state is ServerState.STARTING:
            return f"Starting{where}…"
        if self.state is ServerState.NOT_RESPONDING:
            return f"Not responding{where}"
        if self.state is ServerState.ERROR:
            return f"Error: {self.reason}" if self.reason else "Error"
        if self.offer is not None:
            return f"omlx {self.offer.version} already running on :{self.offer.port}"
        return "Stopped"
