"""The recent-throughput window behind prefill/decode tok/s."""

from __future__ import annotations

import pytest

from omlx.api.metrics import RateWindow


def test_rate_counts_only_the_last_window() -> None:
    window = RateWindow(window_s=5.0)
    window.add(100, now=0.0)
    window.add(50, now=3.0)
    assert window.rate(now=4.0) == pytest.approx(150 / 5.0)
    assert window.rate(now=7.0) == pytest.approx(50 / 5.0)
    assert window.rate(now=20.0) == 0.0


def test_window_stays_bounded_when_nobody_reads_it() -> None:
    # A server nobody scrapes still adds an event per decode step, for weeks.
    window = RateWindow(window_s=5.0)
    for step in range(100_000):
        window.add(1, now=step * 0.01)
    assert len(window) <= 5.0 / 0.01 + 1
    assert window.rate(now=1000.0) == pytest.approx(500 / 5.0, rel=0.01)
