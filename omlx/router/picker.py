"""Which backend serves a request: prefix affinity first, else the least loaded,
only among healthy backends that serve the requested model."""

from __future__ import annotations

import time
from dataclasses import dataclass

from omlx.errors import ServiceUnavailableError
from omlx.router.affinity import AffinityTable
from omlx.router.backends import Backend, BackendSet


@dataclass(frozen=True, slots=True)
class Choice:
    backend: Backend
    reason: str  # "pinned", "affinity" or "least_loaded"
    num_matched_blocks: int = 0


def candidates(backends: BackendSet, model: str | None, exclude: set[str]) -> list[Backend]:
    """Healthy backends listing ``model``; every healthy backend when none lists
    it (no model named, or an alias a backend resolves: it answers 404 if not).

    Raises ServiceUnavailableError when those are all down or excluded."""
    # Ollama clients name "model:latest" what /v1/models lists as "model".
    names = {model, model.removesuffix(":latest")} if model else set()
    serving = [b for b in backends.backends if names & b.model_ids] or backends.backends
    usable = [b for b in serving if b.healthy and b.url not in exclude]
    if not usable:
        down = ", ".join(f"{b.url} ({b.error or 'failed'})" for b in serving)
        what = f"'{model}'" if model else "requests"
        raise ServiceUnavailableError(f"no backend can serve {what} now: {down}", retry_after_s=2)
    now = time.monotonic()
    return [b for b in usable if b.cooling_until <= now] or usable


def _load_key(backend: Backend) -> tuple[int, int, float]:
    # Memory-pressed last; then fewest in flight, then least recently chosen (so
    # equally idle backends take turns; small headroom differences are noise).
    return (int(backend.load.memory_pressed), backend.busy, backend.last_routed_at)


def choose(
    backends: BackendSet,
    affinity: AffinityTable,
    model: str | None,
    hashes: list[bytes],
    max_extra_load: int,
    exclude: set[str] | None = None,
    pinned: str | None = None,
) -> Choice:
    """``pinned``: a backend that must serve it if it can (it holds state the
    request refers to, e.g. a stored response)."""
    usable = candidates(backends, model, exclude or set())
    owner = next((b for b in usable if b.url == pinned), None)
    if owner is not None:
        return Choice(owner, "pinned")
    least = min(usable, key=_load_key)
    match = affinity.lookup(hashes)
    if match is not None:
        owner = next((b for b in usable if b.url == match[0]), None)
        if owner is not None and owner.busy - least.busy <= max_extra_load:
            return Choice(owner, "affinity", match[1])
    return Choice(least, "least_loaded")
