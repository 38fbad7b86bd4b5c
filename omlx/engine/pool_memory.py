"""The pool's memory: the limits in force, the probe that reads the process, the
budget for weights, the live idle baseline and the RAM cache tier, shared by
every engine the pool builds. ``limits`` and ``probe`` may be swapped (settings
change, tests); readers take the one in force."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from omlx.cache.setup import make_hot_tier
from omlx.engine.live_baseline import LiveBaseline
from omlx.engine.worker import MLXWorker
from omlx.memory import mlx_stats
from omlx.memory.budget import DeviceCap, Limits
from omlx.memory.guard import memory_limits
from omlx.memory.probe import MemoryProbe, total_ram_bytes
from omlx.settings import Settings
from omlx.sizes import format_bytes, parse_byte_size

log = logging.getLogger(__name__)


class PoolMemory:
    def __init__(self, settings: Settings, worker: MLXWorker) -> None:
        memory = settings.memory
        ram = total_ram_bytes()
        self._worker = worker
        self.device_cap = _read_device_cap()
        self.limits = memory_limits(memory, ram, self.device_cap)
        self.model_budget_bytes = _model_budget(memory.max_model_memory, self.limits.hard_bytes)
        # MLX's counters are sampled on the MLX thread after every turn and
        # published; readings on other threads (HTTP, enforcer) use that sample.
        self.probe = MemoryProbe(memory.poll_interval_s, on_mlx_thread=worker.on_thread)
        # What the process holds with nothing in flight, for every model's guard.
        self.live_baseline = LiveBaseline(lambda: self.probe, worker)
        self.baseline = self.live_baseline.baseline
        self.hot_cache = make_hot_tier(settings, ram)
        self._mlx_limits: Limits | None = None
        self._apply_mlx_limits()
        log.info(
            "memguard: hard limit %s (max_process_memory=%s, RAM %s, %s), soft %s, "
            "transient margin %s, weights budget %s",
            format_bytes(self.limits.hard_bytes),
            memory.max_process_memory,
            format_bytes(ram),
            _cap_words(self.device_cap),
            format_bytes(self.limits.soft_bytes),
            format_bytes(self.limits.transient_margin_bytes)
            if self.limits.margin_pinned
            else "auto (each model's measured step transient x1.25, at least 64 MiB)",
            format_bytes(self.model_budget_bytes),
        )

    def publish(self, engines: Iterable[Any]) -> None:
        """The limits in force to every engine's guard and to MLX."""
        for engine in engines:
            engine.guard.publish(self.limits)
        self._apply_mlx_limits()

    def _apply_mlx_limits(self) -> None:
        """MLX's own memory/cache limits follow the hard limit (set on the MLX thread)."""
        if self._mlx_limits is not self.limits:
            self._mlx_limits = self.limits
            self._worker.post(mlx_stats.apply_limits, self.limits)


def _read_device_cap() -> DeviceCap:
    """The GPU's cap, read once as the pool is built. On this thread, not the worker's:
    the worker may not run yet (the server starts it later), and a device query
    allocates nothing, before any request exists."""
    try:
        return mlx_stats.device_cap()
    except Exception as exc:  # a broken device query must not stop the server
        log.warning("memguard: could not read the GPU's memory cap (%s); none applied", exc)
        return DeviceCap()


def _cap_words(cap: DeviceCap) -> str:
    if cap.cap_bytes is None:
        return "no Metal working-set cap: CPU backend"
    parts = []
    if cap.working_set_bytes is not None:
        parts.append(f"Metal working set {format_bytes(cap.working_set_bytes)}")
    if cap.wired_limit_bytes is not None:
        parts.append(f"wired limit {format_bytes(cap.wired_limit_bytes)}")
    return ", ".join(parts)


def _model_budget(value: str | int, hard_bytes: int) -> int:
    if value == "auto":
        return hard_bytes
    return min(hard_bytes, parse_byte_size(value, total_bytes=hard_bytes, field="max_model_memory"))
