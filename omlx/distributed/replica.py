"""Every rank runs the same runner calls in the same order, so every forward meets its
collectives (tensor-parallel sums, pipeline sends) on all ranks.

On rank 0, ``ReplicatingRunner`` wraps the engine's BatchRunner: each method call goes
out by name (so it follows the runner's API as it changes), then runs locally, then
every follower's reply is awaited. On the others, ``follow`` replays the calls on
their own BatchRunner until rank 0 closes the connection."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import pickle
import secrets
import socket
from collections.abc import Callable
from typing import Any

from omlx.distributed.control import Leader, recv_frame, send_frame
from omlx.scheduler import Request

log = logging.getLogger(__name__)

# Pure queries of the runner's state: answered by rank 0's runner alone (the same
# on every rank), so they cost no round trip.
LOCAL_QUERIES = frozenset(
    {"layout", "prefill_plan", "prove_compiled", "speculation_plan", "speculative_stats"}
)
# Calls that do nothing given an empty list (the engine makes them every step): skipped
# on every rank, which saves the followers' round trip.
NOTHING_WHEN_EMPTY = frozenset({"add", "remove"})
# Calls that only drop state: once a rank is lost they succeed without running (the
# engine calls them to fail its requests), so nothing waits on the broken group.
CLEAN_UPS = frozenset({"reset", "close", "remove"})


class ReplicatingRunner:
    """Rank 0's runner: the engine's calls, replayed on every follower."""

    def __init__(self, inner: Any, leader: Leader):
        self._inner = inner
        self._leader = leader

    @property
    def has_work(self) -> bool:
        # A lost group runs nothing more: the engine failed its requests, and the clean
        # ups that would empty the inner runner are skipped (CLEAN_UPS), so its own
        # count would ask the engine to step, and fail, again and again.
        return not self._leader.lost and bool(self._inner.has_work)

    def raise_if_lost(self) -> None:
        """The 503 naming a lost rank, if one is lost (checked before queueing work)."""
        self._leader.check_alive()
        self._leader.raise_if_lost()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in LOCAL_QUERIES or not inspect.ismethod(attr):
            return attr  # properties (has_work) are read locally
        return lambda *args, **kwargs: self._replicated(name, args, kwargs)

    def _replicated(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in NOTHING_WHEN_EMPTY and args and not args[0]:
            return {} if name == "add" else None  # add: no cached tokens to report
        method = getattr(self._inner, name)
        args, kwargs = replay_arguments(method, args, kwargs)
        if self._leader.lost and name in CLEAN_UPS:
            # Nothing more runs on this group; its lazy arrays may wait on the dead ring.
            return None
        self._leader.call(("runner", name, args, kwargs))
        try:
            result = method(*args, **kwargs)
        except Exception:
            # A ring error here usually means a rank died: name it if it did.
            self._leader.collect()
            raise
        self._leader.collect()
        return result


def replay_arguments(
    method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments as every rank runs them: a seed for every sampled request
    without one (in a list of requests or a plan's fields), so all ranks draw the
    same tokens. (The plan carries every memory decision, shared openings too.)"""
    bound = inspect.signature(method).bind(*args, **kwargs)
    for name, value in bound.arguments.items():
        bound.arguments[name] = _with_seeds(value)
    return bound.args, bound.kwargs


def _with_seeds(value: Any) -> Any:
    if isinstance(value, Request):
        return _seeded(value)
    if isinstance(value, list | tuple) and any(isinstance(v, Request) for v in value):
        return type(value)(_with_seeds(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {
            f.name: seeded
            for f in dataclasses.fields(value)
            if (seeded := _with_seeds(getattr(value, f.name))) is not getattr(value, f.name)
        }
        return dataclasses.replace(value, **changed) if changed else value
    return value


def _seeded(request: Request) -> Request:
    sampling = request.sampling
    if sampling.is_greedy or sampling.seed is not None:
        return request
    seed = secrets.randbits(63)
    return dataclasses.replace(request, sampling=dataclasses.replace(sampling, seed=seed))


def follow(
    sock: socket.socket,
    load: Callable[[str], Any],
    facts: Callable[[], dict[str, Any]],
) -> int:
    """A follower's life: replay rank 0's calls until it closes the connection (0),
    or stop at the first call that fails here (1: this rank cannot keep in step).
    ``load(name)`` builds the runner for a model; ``facts()``: this rank's memory reading
    and prefix-cache counters, sent with every reply."""
    runner: Any = None
    while True:
        try:
            frame = recv_frame(sock)
        except (ConnectionError, OSError):
            log.info("distributed: rank 0 closed the control connection; stopping")
            return 0
        kind, name, args, kwargs = pickle.loads(frame)  # only rank 0 (token-checked) sends
        try:
            if kind == "load":
                if runner is not None:
                    runner.close()
                runner = load(name)
            elif runner is None:
                raise RuntimeError(f"rank 0 asked for {name} before any model was loaded")
            else:
                getattr(runner, name)(*args, **kwargs)
        except Exception as exc:
            log.exception("distributed: %s %s failed on this rank", kind, name)
            _reply(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return 1
        _reply(sock, {"ok": True, **facts()})


def _reply(sock: socket.socket, reply: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # rank 0 is gone; the next receive ends the loop
        send_frame(sock, json.dumps(reply).encode())
