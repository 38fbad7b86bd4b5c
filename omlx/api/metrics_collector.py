"""What ``/metrics`` and ``/admin/api/stats`` read at request time: the edge
counters of ``ServerMetrics`` plus the pool's own numbers (models, in-flight
requests, memory, cache tiers). Both views are built from one ``Snapshot``, so
they agree."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omlx.api.metrics import ServerMetrics
from omlx.api.state import ServerState
from omlx.cache.hot import HotTierStats


@dataclass(frozen=True, slots=True)
class Snapshot:
    uptime_s: float
    models: list[dict[str, Any]]  # pool.status() rows of loaded models
    queue_depth: dict[str, int]
    memory: dict[str, int]
    num_loads: int
    num_evictions: int
    hot: HotTierStats | None
    prefix: dict[str, dict[str, Any]]  # model -> PrefixCache.stats()
    prefill_rate: float
    decode_rate: float
    # Above the soft limit the enforcer pauses admission: now, and how often.
    admission_paused: bool = False
    num_admission_pauses: int = 0

    @property
    def ssd_bytes(self) -> int:
        return sum((s["ssd"] or {}).get("total_bytes", 0) for s in self.prefix.values())


def take_snapshot(state: ServerState, metrics: ServerMetrics) -> Snapshot:
    pool = state.pool
    reading = pool.probe.reading()
    loaded = {e.name: e for e in pool.loaded()}
    return Snapshot(
        uptime_s=time.time() - state.started_s,
        models=[m for m in pool.status() if m["name"] in loaded],
        queue_depth={e.name: e.num_queued for e in loaded.values()},
        memory={
            "used_bytes": reading.resident_bytes,
            "soft_limit_bytes": pool.limits.soft_bytes,
            "hard_limit_bytes": pool.limits.hard_bytes,
            "mlx_active_bytes": reading.mlx_active_bytes,
            "mlx_cache_bytes": reading.mlx_cache_bytes,
            "process_bytes": reading.process_footprint_bytes,
            "model_budget_bytes": pool.model_budget_bytes,
            "baseline_bytes": pool.baseline.bytes_now(reading),
        },
        num_loads=pool.num_loads,
        num_evictions=pool.num_evictions,
        hot=pool.hot_cache.stats() if pool.hot_cache is not None else None,
        prefix={n: e.prefix_cache.stats() for n, e in loaded.items() if e.prefix_cache},
        prefill_rate=metrics.prefill.rate(),
        decode_rate=metrics.decode.rate(),
        admission_paused=pool.enforcer.admission_paused,
        num_admission_pauses=pool.enforcer.num_admission_pauses,
    )


def stats_body(snap: Snapshot, metrics: ServerMetrics) -> dict[str, Any]:
    """The ``/admin/api/stats`` JSON (the dashboard and desktop shell read it)."""
    total, errors = metrics.inference_totals()
    prompt = sum(metrics.prompt_tokens.values())
    cached = sum(metrics.cached_tokens.values())
    return {
        "uptime_s": round(snap.uptime_s, 3),
        "requests": {
            "total": total,
            "in_flight": sum(m["requests_in_flight"] for m in snap.models),
            "queued": sum(snap.queue_depth.values()),
            "errors": errors,
        },
        "tokens": {
            "prompt_total": prompt,
            "completion_total": sum(metrics.completion_tokens.values()),
            "cached_total": cached,
        },
        "throughput": {
            "prefill_tokens_per_s": round(snap.prefill_rate, 3),
            "decode_tokens_per_s": round(snap.decode_rate, 3),
        },
        "memory": {
            k: snap.memory[k] for k in ("used_bytes", "soft_limit_bytes", "hard_limit_bytes")
        },
        "cache": {
            # Share of prompt tokens served from the prefix cache.
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "tokens_saved": cached,
            "hot_bytes": snap.hot.hot_bytes if snap.hot is not None else 0,
            "ssd_bytes": snap.ssd_bytes,
        },
    }


def _counter(name: str, doc: str, labels: list[str], rows: dict[Any, int]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in sorted(rows.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family


def _gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


def _per_model(name: str, doc: str, rows: dict[str, int | float]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["model"])
    for model, value in sorted(rows.items()):
        family.add_metric([model], value)
    return family


class PoolCollector(Collector):
    """Builds the non-histogram metrics from a fresh snapshot at every scrape."""

    def __init__(self, state: ServerState, metrics: ServerMetrics):
        self._state = state
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # families are only known at scrape time

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        snap = take_snapshot(self._state, m)
        yield _counter(
            "omlx_http_requests",
            "HTTP responses by route template, method and status",
            ["route", "method", "status"],
            dict(m.requests),
        )
        yield _counter("omlx_prompt_tokens", "Prompt tokens", ["model"], dict(m.prompt_tokens))
        yield _counter(
            "omlx_completion_tokens", "Generated tokens", ["model"], dict(m.completion_tokens)
        )
        yield _counter(
            "omlx_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            ["model"],
            dict(m.cached_tokens),
        )
        yield _counter(
            "omlx_stream_errors",
            "Requests that ended with an error after they started",
            ["model"],
            dict(m.stream_errors),
        )
        yield _gauge("omlx_uptime_seconds", "Seconds since the server started", snap.uptime_s)
        yield from _requests(snap)
        yield from _memory(snap)
        yield from _memory_guard(snap)
        yield from _speculative(snap)
        yield from _cache(snap)

    def __repr__(self) -> str:
        return "PoolCollector()"


def _requests(snap: Snapshot) -> Iterator[Metric]:
    yield _per_model(
        "omlx_requests_in_flight",
        "Requests submitted to a model and not finished (running or queued)",
        {m["name"]: m["requests_in_flight"] for m in snap.models},
    )
    yield _per_model(
        "omlx_queue_depth",
        "Requests waiting to be admitted (for a slot or for memory)",
        {m["name"]: snap.queue_depth.get(m["name"], 0) for m in snap.models},
    )
    yield _gauge(
        "omlx_prefill_tokens_per_second",
        "Prompt tokens computed per second over the last 5 s (cache hits excluded)",
        snap.prefill_rate,
    )
    yield _gauge(
        "omlx_decode_tokens_per_second",
        "Tokens generated per second over the last 5 s",
        snap.decode_rate,
    )
    yield _gauge("omlx_models_loaded", "Models loaded now", len(snap.models))
    yield _counter("omlx_model_loads", "Model loads", [], {(): snap.num_loads})
    yield _counter(
        "omlx_model_evictions", "Models unloaded to make room", [], {(): snap.num_evictions}
    )


def _memory(snap: Snapshot) -> Iterator[Metric]:
    docs = {
        "used_bytes": "Memory in use (max of MLX active plus cache, and the process footprint)",
        "soft_limit_bytes": "Soft limit: admission pauses and idle models are evicted above it",
        "hard_limit_bytes": "Hard limit: running requests are ended above it",
        "mlx_active_bytes": "MLX active memory (weights, KV caches, transients)",
        "mlx_cache_bytes": "Freed MLX buffers kept for reuse (still held by the process)",
        "process_bytes": "Process footprint (phys_footprint on macOS, RSS on Linux)",
        "model_budget_bytes": "Budget for loaded weights across models",
        "baseline_bytes": "Memory in use with nothing in flight (the front door's baseline)",
    }
    for key, doc in docs.items():
        yield _gauge(f"omlx_memory_{key}", doc, snap.memory[key])
    yield _per_model(
        "omlx_model_weights_bytes",
        "Bytes of each loaded model's weights",
        {m["name"]: m["memory_bytes"] for m in snap.models},
    )


def _speculative(snap: Snapshot) -> Iterator[Metric]:
    """Speculative decoding per model: what was drafted and kept, and its rates."""
    spec = {m["name"]: m["speculative"] for m in snap.models if m.get("speculative")}
    for key, doc in (
        ("drafted", "Tokens drafted for verification (speculative decoding)"),
        ("accepted", "Drafted tokens the model agreed with and kept"),
        ("steps", "Decode steps that verified drafts"),
        ("row_steps", "Requests advanced by those steps (one per request and step)"),
        ("tokens", "Tokens handed out by those steps (kept drafts plus one per request)"),
    ):
        yield _counter(
            f"omlx_speculative_{key}", doc, ["model"], {n: s[key] for n, s in spec.items()}
        )
    yield _per_model(
        "omlx_speculative_acceptance_rate",
        "Kept drafted tokens over drafted tokens since the model loaded",
        {n: s["accepted"] / s["drafted"] if s["drafted"] else 0.0 for n, s in spec.items()},
    )
    yield _per_model(
        "omlx_speculative_tokens_per_step",
        "Tokens per request and speculative step since the model loaded (1 without drafts)",
        {n: s["tokens"] / s["row_steps"] if s["row_steps"] else 0.0 for n, s in spec.items()},
    )


def _memory_guard(snap: Snapshot) -> Iterator[Metric]:
    """What the guard did short of refusing at the front door, per model."""
    guards = {m["name"]: m["memory_guard"] for m in snap.models if m.get("memory_guard")}
    yield _counter(
        "omlx_memory_deferrals",
        "Admission deferrals (a queued request re-checked next step), by reason",
        ["model", "reason"],
        {(name, why): n for name, g in guards.items() for why, n in g["deferrals"].items()},
    )
    yield _counter(
        "omlx_memory_preemptions",
        "Running requests put back in the queue to resume later, by what ran short",
        ["model", "reason"],
        {(name, why): n for name, g in guards.items() for why, n in g.get("preempted", {}).items()},
    )
    for key, doc in (
        ("gate_ended", "Requests the forward gate ended (503) before a prefill chunk"),
        ("throttled_steps", "Steps whose prefill chunks the gate capped to fit"),
        ("held_steps", "Steps whose prefill waited for decoding requests to free memory"),
        ("reclaims", "Times the gate handed MLX's free cache back before deciding"),
        ("unshared_openings", "Shared openings the gate held back (prefilled per request)"),
        ("held_drafts", "Speculative steps the gate ran without drafts (plain decode)"),
        ("held_encodes", "Image encodes the gate held back (their requests waited or ended)"),
    ):
        yield _counter(f"omlx_memory_{key}", doc, ["model"], {n: g[key] for n, g in guards.items()})
    yield _gauge(
        "omlx_memory_admission_paused",
        "1 while memory is above the soft limit and admission is paused",
        int(snap.admission_paused),
    )
    yield _counter(
        "omlx_memory_admission_pauses",
        "Times admission was paused above the soft limit",
        [],
        {(): snap.num_admission_pauses},
    )


def _cache(snap: Snapshot) -> Iterator[Metric]:
    hot = asdict(snap.hot) if snap.hot is not None else None
    ssd = [s["ssd"] for s in snap.prefix.values() if s["ssd"]]
    tiers: dict[str, dict[str, int]] = {}
    if hot is not None:
        tiers["hot"] = {
            "hits": hot["hot_hits"],
            "misses": hot["hot_misses"],
            "evictions": hot["evictions"],
            "bytes": hot["hot_bytes"],
            "blocks": hot["hot_blocks"],
        }
    if ssd:
        tiers["ssd"] = {
            key: sum(s[field] for s in ssd)
            for key, field in (
                ("hits", "hits"),
                ("misses", "misses"),
                ("evictions", "evictions"),
                ("bytes", "total_bytes"),
                ("blocks", "num_blocks"),
            )
        }
    for key, doc in (("hits", "Block hits"), ("misses", "Block misses")):
        yield _counter(f"omlx_cache_{key}", doc, ["tier"], {t: v[key] for t, v in tiers.items()})
    yield _counter(
        "omlx_cache_evictions",
        "Blocks evicted",
        ["tier"],
        {t: v["evictions"] for t, v in tiers.items()},
    )
    for key, doc in (("bytes", "Bytes held"), ("blocks", "Blocks held")):
        family = GaugeMetricFamily(f"omlx_cache_{key}", doc, labels=["tier"])
        for tier, values in sorted(tiers.items()):
            family.add_metric([tier], values[key])
        yield family
    if hot is not None:
        yield _gauge("omlx_cache_hot_max_bytes", "Byte budget of the RAM tier", hot["max_bytes"])
    for key, doc in (
        ("saves", "Blocks accepted for writing to the SSD tier"),
        ("saves_persisted", "Blocks whose SSD file was written (atomically renamed in)"),
        ("drops", "Blocks dropped instead of written (writer saturated or store closed)"),
    ):
        yield _counter(
            f"omlx_cache_ssd_{key}",
            doc,
            ["model"],
            {model: s["ssd"][key] for model, s in snap.prefix.items() if s["ssd"]},
        )
    for key, doc in (
        ("lookups", "Prefix lookups"),
        ("hits", "Prefix lookups that found cached tokens"),
        ("misses", "Prefix lookups that found nothing"),
        ("tokens_saved", "Prompt tokens restored from the cache"),
    ):
        yield _counter(
            f"omlx_prefix_cache_{key}",
            doc,
            ["model"],
            {model: s[key] for model, s in snap.prefix.items()},
        )
