"""MLX's peak counter is one per process and every probe sample restarts it: a pass
a probe is watching keeps its peak when another MLX thread's probe (another
worker in the same process) samples in the middle of it, and that probe's own
next sample still sees the peak too."""

from __future__ import annotations

import threading

import mlx.core as mx

from omlx.memory import mlx_stats
from omlx.memory.probe import MemoryProbe

MB = 1024**2
TRANSIENT = 64 * MB


def sample_on_another_thread(probe: MemoryProbe) -> int:
    """A fresh reading taken on a thread of its own (as another worker would); its peak."""
    peaks: list[int] = []
    thread = threading.Thread(
        target=lambda: peaks.append(probe.reading(fresh=True).recent_peak_bytes)
    )
    thread.start()
    thread.join()
    return peaks[0]


def transient() -> None:
    """TRANSIENT bytes allocated, used and freed (back in MLX's cache, not active)."""
    block = mx.full((TRANSIENT // 4,), 1.0, dtype=mx.float32)
    mx.eval(block)
    del block


def test_a_watched_pass_keeps_its_peak_when_another_probe_samples_mid_pass() -> None:
    mlx_stats.release_cache()
    mine = MemoryProbe()
    other = MemoryProbe(on_mlx_thread=lambda: True)
    other.reading(fresh=True)  # the other probe has sampled before
    start = mine.watch_peak()
    transient()
    # The other worker's idle wake samples MLX's counters (and restarts the peak).
    sample_on_another_thread(other)
    peak, _ = mine.watched_peak()
    assert peak - start.mlx_active_bytes >= TRANSIENT


def test_each_probe_sees_a_peak_another_probe_restarted() -> None:
    mlx_stats.release_cache()
    # ``second`` counts only its latest sample's peak (no window of earlier ones).
    first, second = MemoryProbe(), MemoryProbe(peak_window_s=0.0)
    first.reading(fresh=True)
    second.reading(fresh=True)
    before = mx.get_active_memory()
    transient()
    assert first.reading(fresh=True).recent_peak_bytes >= before + TRANSIENT
    # ``first`` restarted MLX's counter; ``second`` still sees the transient once...
    assert second.reading(fresh=True).recent_peak_bytes >= before + TRANSIENT
    # ...and its next sample starts from where the counter is now.
    assert second.reading(fresh=True).recent_peak_bytes < before + TRANSIENT
