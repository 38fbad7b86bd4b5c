"""What the shell shows: the server's state as one immutable snapshot."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


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
class ModelReadiness:
    """One model the server loads at start, as its /health reports it."""

    name: str
    state: str  # "loading", "ready" or "failed"
    reason: str = ""  # why it failed


def readiness_from_health(body: Any) -> tuple[ModelReadiness, ...]:
    """The models of a /health body (an older omlx reports none; junk is skipped)."""
    models = body.get("models") if isinstance(body, dict) else None
    out = []
    for model in models if isinstance(models, list) else []:
        if isinstance(model, dict) and isinstance(model.get("name"), str):
            out.append(
                ModelReadiness(model["name"], str(model.get("state")), str(model.get("reason", "")))
            )
    return tuple(out)


# A failure reason longer than this is cut in the menu (the full one is in the log).
REASON_CHARS = 80


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
    models: tuple[ModelReadiness, ...] = ()  # loading at start, from /health

    def models_line(self) -> str:
        """The menu's model line while running: loading, then ready (or why not)."""
        if self.state is not ServerState.RUNNING:
            return ""
        loading = [m.name for m in self.models if m.state == "loading"]
        if loading:
            return f"Loading {', '.join(loading)}…"
        failed = next((m for m in self.models if m.state == "failed"), None)
        if failed is not None:
            reason = (
                failed.reason
                if len(failed.reason) <= REASON_CHARS
                else (failed.reason[: REASON_CHARS - 1] + "…")
            )
            return f"{failed.name} failed to load: {reason}"
        ready = [m.name for m in self.models if m.state == "ready"]
        return f"{', '.join(ready)} ready" if ready else ""

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
