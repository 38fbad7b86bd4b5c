"""``GET /metrics`` of the router (Prometheus text): per backend its health,
load and the requests routed to it."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omlx.router.affinity import AffinityTable
from omlx.router.backends import BackendSet
from omlx.router.proxy import RouteStats


class RouterCollector(Collector):
    def __init__(self, backends: BackendSet, affinity: AffinityTable, stats: RouteStats):
        self._backends = backends
        self._affinity = affinity
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # built at scrape time

    def collect(self) -> Iterator[Metric]:
        yield from self._backend_gauges()
        yield from self._routing()

    def _backend_gauges(self) -> Iterator[Metric]:
        rows = self._backends.backends
        gauges = (
            ("up", "1 while the backend passes health checks", lambda b: int(b.healthy)),
            ("in_flight", "Requests the router has in flight there", lambda b: b.num_in_flight),
            (
                "requests_in_flight",
                "Requests in flight there, as its /metrics said at the last poll",
                lambda b: b.load.requests_in_flight,
            ),
            ("queue_depth", "Its queue depth at the last poll", lambda b: b.load.queue_depth),
            (
                "memory_headroom_bytes",
                "Its soft memory limit minus memory in use, at the last poll",
                lambda b: b.load.headroom_bytes,
            ),
            ("models", "Models it serves", lambda b: len(b.models)),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"omlx_router_backend_{name}", doc, labels=["backend"])
            for backend in rows:
                family.add_metric([backend.url], value(backend))
            yield family

    def _routing(self) -> Iterator[Metric]:
        routed = CounterMetricFamily(
            "omlx_router_requests_routed",
            "Requests routed, by backend and reason (affinity, least_loaded, retry)",
            labels=["backend", "reason"],
        )
        for (url, reason), n in sorted(self._stats.routed.items()):
            routed.add_metric([url, reason], n)
        yield routed
        retried = CounterMetricFamily(
            "omlx_router_retries",
            "Requests retried elsewhere after this backend failed before any output",
            labels=["backend"],
        )
        for url, n in sorted(self._stats.retried.items()):
            retried.add_metric([url], n)
        yield retried
        entries = GaugeMetricFamily(
            "omlx_router_affinity_entries", "Prompt-block hashes remembered for affinity"
        )
        entries.add_metric([], len(self._affinity))
        yield entries


def router_registry(
    backends: BackendSet, affinity: AffinityTable, stats: RouteStats
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(RouterCollector(backends, affinity, stats))
    return registry
