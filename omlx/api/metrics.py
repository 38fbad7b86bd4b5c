"""Counters observed at the API edge: requests by route and status, tokens, TTFT,
time per output token, and recent throughput.

One ``ServerMetrics`` per app (made in ``create_app``), owning its prometheus
registry. ``/metrics`` and ``/admin/api/stats`` both read these same counters
(plus what the pool reports at scrape time, see ``metrics_collector``).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omlx.engine.stream import StreamEvent

# The routes that run a model: what the dashboard counts as requests.
INFERENCE_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/responses",
        "/api/chat",
        "/api/generate",
    }
)
THROUGHPUT_WINDOW_S = 5.0
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RateWindow:
    """Tokens per second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def __len__(self) -> int:
        return len(self._events)

    def add(self, num: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if num > 0:
            self._events.append((now, num))
        # Pruned here too: with nobody scraping, the window must not grow for ever.
        self._prune(now)

    def rate(self, now: float | None = None) -> float:
        self._prune(time.monotonic() if now is None else now)
        return sum(n for _, n in self._events) / self.window_s

    def _prune(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.popleft()


@dataclass(slots=True)
class _StreamState:
    seen: bool = False
    done: bool = False
    num_output: int = 0
    first_s: float | None = None
    last_s: float = 0.0


class ServerMetrics:
    """Edge counters. Every method runs on the event loop, so no locks."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests: Counter[tuple[str, str, str]] = Counter()  # (route, method, status)
        self.prompt_tokens: Counter[str] = Counter()  # by model
        self.completion_tokens: Counter[str] = Counter()
        self.cached_tokens: Counter[str] = Counter()
        self.stream_errors: Counter[str] = Counter()
        self.prefill = RateWindow()
        self.decode = RateWindow()
        self.ttft = Histogram(
            "omlx_time_to_first_token_seconds",
            "Time from submit to the first output token, per request",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "omlx_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            ["model"],
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )

    def observer(self) -> GenerationObserver:
        return GenerationObserver(self)

    def inference_totals(self) -> tuple[int, int]:
        """(requests, errors) on the inference routes; a stream that ended with an
        error event counts as an error too."""
        total = errors = 0
        for (route, _, status), n in self.requests.items():
            if route in INFERENCE_ROUTES:
                total += n
                errors += n if int(status) >= 400 else 0
        return total, errors + sum(self.stream_errors.values())


class GenerationObserver:
    """One HTTP call's streams, as ``Generation`` sees their events."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics
        self.model: str | None = None
        self._start_s = time.perf_counter()
        self._streams: list[_StreamState] = []

    def started(self, model: str, num_streams: int) -> None:
        self.model = model
        self._start_s = time.perf_counter()
        self._streams = [_StreamState() for _ in range(num_streams)]

    def event(self, index: int, event: StreamEvent) -> None:
        if self.model is None:
            return
        m, model, stream = self._metrics, self.model, self._streams[index]
        now = time.perf_counter()
        if not stream.seen and event.num_prompt_tokens:
            stream.seen = True
            m.prompt_tokens[model] += event.num_prompt_tokens
            m.cached_tokens[model] += event.num_cached_tokens
            m.prefill.add(event.num_prompt_tokens - event.num_cached_tokens)
        new = event.num_output_tokens - stream.num_output
        if new > 0:
            if stream.first_s is None:
                stream.first_s = now
                m.ttft.labels(model).observe(now - self._start_s)
            m.completion_tokens[model] += new
            m.decode.add(new)
            stream.num_output, stream.last_s = event.num_output_tokens, now
        if event.error is not None:
            m.stream_errors[model] += 1
        if event.finished:
            self._finish(stream)

    def _finish(self, stream: _StreamState) -> None:
        stream.done = True
        if stream.first_s is not None and stream.num_output > 1:
            per_token = (stream.last_s - stream.first_s) / (stream.num_output - 1)
            self._metrics.tpot.labels(self.model).observe(per_token)

    def close(self) -> None:
        """The generation ended (finished, failed or abandoned by the client)."""
        for stream in self._streams:
            stream.done = True


def observer_for(request: Request) -> GenerationObserver | None:
    """A new observer from the app's metrics (None in apps built without them)."""
    metrics: ServerMetrics | None = getattr(request.app.state, "metrics", None)
    return metrics.observer() if metrics is not None else None


def route_label(scope: Scope) -> str:
    """The route's path template, so labels stay few (no model names, no ids)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    # Refused before routing (e.g. 413): still an inference request if the path says so.
    return scope["path"] if scope["path"] in INFERENCE_ROUTES else "unmatched"


class RequestMetricsMiddleware:
    """Counts every HTTP response by route template, method and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start" and not status:
                status.append(message["status"])
                self._count(scope, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:  # not a cancellation: the client left, nothing was answered
            if not status:
                self._count(scope, 500)
            raise

    def _count(self, scope: Scope, status: int) -> None:
        self.metrics.requests[(route_label(scope), scope["method"], str(status))] += 1
