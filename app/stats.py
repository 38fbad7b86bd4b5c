"""The stats submenu's numbers: /admin/api/stats, or what /health offers without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class Stats:
    source: str  # "stats" or "health"
    requests_total: int | None = None
    requests_in_flight: int | None = None
    requests_queued: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    decode_tokens_per_s: float | None = None
    memory_used_bytes: int | None = None
    memory_limit_bytes: int | None = None
    cache_hit_rate: float | None = None

    def lines(self) -> list[str]:
        """One menu line per figure; unknown figures are left out rather than shown as 0."""
        out: list[str] = []
        if self.requests_in_flight is not None:
            total = f", {self.requests_total} total" if self.requests_total is not None else ""
            queued = f", {self.requests_queued} queued" if self.requests_queued is not None else ""
            out.append(f"Requests: {self.requests_in_flight} running{queued}{total}")
        if self.prompt_tokens is not None and self.completion_tokens is not None:
            out.append(f"Tokens: {self.prompt_tokens:,} in, {self.completion_tokens:,} out")
        if self.decode_tokens_per_s is not None:
            out.append(f"Decode: {self.decode_tokens_per_s:.1f} tok/s")
        if self.cache_hit_rate is not None:
            out.append(f"Cache hit rate: {self.cache_hit_rate:.0%}")
        if self.memory_used_bytes is not None:
            limit = f" of {_gb(self.memory_limit_bytes)}" if self.memory_limit_bytes else ""
            out.append(f"Memory: {_gb(self.memory_used_bytes)}{limit}")
        return out or ["No statistics yet"]


def _gb(num_bytes: int | None) -> str:
    return f"{(num_bytes or 0) / 2**30:.1f} GB"


def _get(body: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if not isinstance(body, dict):
            return None
        body = body.get(key)  # type: ignore[assignment]
    return body


def from_stats(body: dict[str, Any]) -> Stats:
    return Stats(
        source="stats",
        requests_total=_get(body, "requests", "total"),
        requests_in_flight=_get(body, "requests", "in_flight"),
        requests_queued=_get(body, "requests", "queued"),
        prompt_tokens=_get(body, "tokens", "prompt_total"),
        completion_tokens=_get(body, "tokens", "completion_total"),
        decode_tokens_per_s=_get(body, "throughput", "decode_tokens_per_s"),
        memory_used_bytes=_get(body, "memory", "used_bytes"),
        memory_limit_bytes=_get(body, "memory", "hard_limit_bytes"),
        cache_hit_rate=_get(body, "cache", "hit_rate"),
    )


def from_health(body: dict[str, Any]) -> Stats:
    models = body.get("loaded_models") or []
    return Stats(
        source="health",
        requests_in_flight=sum(int(m.get("requests_in_flight", 0)) for m in models),
        memory_used_bytes=_get(body, "memory", "current_bytes"),
        memory_limit_bytes=_get(body, "memory", "limit_bytes"),
    )


def fetch_stats(base_url: str, api_key: str | None = None, timeout_s: float = 2.0) -> Stats | None:
    """Read the server's stats; None when the server does not answer at all."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url + "/admin/api/stats", headers=headers, timeout=timeout_s)
        if resp.status_code == 200:
            return from_stats(resp.json())
        health = httpx.get(base_url + "/health", timeout=timeout_s)
        return from_health(health.json()) if health.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
