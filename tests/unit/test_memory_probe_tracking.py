"""MemoryProbe.track_process: a helper process's memory counts as the server's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from omlx.memory.probe import MemoryProbe

pytestmark = pytest.mark.spawns  # each test runs a child process

CHILD_BYTES = 256 * 1024 * 1024
# Writes every page (a zeroed allocation would not be resident), then waits.
CHILD = f"import sys; b = b'x' * {CHILD_BYTES}; print('ready', flush=True); sys.stdin.read()"


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def test_tracked_process_memory_is_added_until_untracked(child: subprocess.Popen[str]) -> None:
    probe = MemoryProbe(max_age_s=60.0)
    alone = probe.reading(fresh=True).process_footprint_bytes
    probe.track_process(child.pid)
    # Tracking invalidates the cached reading: the next one includes the child.
    tracked = probe.reading().process_footprint_bytes
    assert tracked - alone >= CHILD_BYTES * 0.9
    probe.untrack_process(child.pid)
    after = probe.reading().process_footprint_bytes
    assert after - alone < CHILD_BYTES * 0.5


def test_a_tracked_process_that_exits_stops_counting(child: subprocess.Popen[str]) -> None:
    probe = MemoryProbe(max_age_s=0.0)
    alone = probe.reading(fresh=True).process_footprint_bytes
    probe.track_process(child.pid)
    child.kill()
    child.wait()
    # No error, and the dead child adds nothing.
    assert probe.reading(fresh=True).process_footprint_bytes - alone < CHILD_BYTES * 0.5
    probe.untrack_process(child.pid)
    probe.track_process(child.pid)  # already gone: ignored
    assert probe.reading(fresh=True).process_footprint_bytes - alone < CHILD_BYTES * 0.5
