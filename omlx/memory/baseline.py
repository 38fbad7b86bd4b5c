"""What the process holds with nothing in flight, kept live. Pure: no MLX.

The front door and each model's KV capacity ask "could this prompt fit once
the work in flight drained?". A number frozen when a model loaded would keep
co-resident models unloaded since (false refusals) and miss ones loaded later
(prompts let in that the forward gate then ends). So the MLX worker observes
the process whenever no engine has work; between observations, loads and
unloads move the number by what they measured; and a live reading lower than
it wins, since memory handed back is gone whatever the bookkeeping says.
"""

from __future__ import annotations

import threading

from omlx.memory.budget import MemoryReading

__all__ = ["IdleBaseline"]


class IdleBaseline:
    """Bytes in use with nothing in flight: weights, runtime, the prefix cache's
    RAM tier. MLX's cache of freed buffers is left out: it is handed back on
    demand (the forward gate clears it before refusing anything)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observed = 0
        # Loads (+) and unloads (-) since the last observation.
        self._moved = 0
        self.num_observations = 0

    def observe_idle(self, reading: MemoryReading) -> None:
        """MLX thread, nothing in flight: ``reading`` is the baseline itself."""
        with self._lock:
            self._observed = reading.in_use_bytes
            self._moved = 0
            self.num_observations += 1

    def moved(self, num_bytes: int) -> None:
        """MLX thread, work in flight: a model load (+) or unload (-) changed the
        baseline by ``num_bytes`` (its weights, as the worker measured them)."""
        with self._lock:
            self._moved += num_bytes

    def bytes_now(self, live: MemoryReading | None = None) -> int:
        """The baseline; never above ``live`` (what is in use right now). Before
        the first observation, ``live`` itself (or 0 without one)."""
        with self._lock:
            observed = self.num_observations > 0
            estimate = max(0, self._observed + self._moved)
        if live is None:
            return estimate
        return min(estimate, live.in_use_bytes) if observed else live.in_use_bytes
