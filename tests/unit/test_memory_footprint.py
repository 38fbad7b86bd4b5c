"""The platform footprint reading: macOS's phys_footprint parsed from the kernel's
struct (built here byte for byte in the <sys/resource.h> layout), and the fall back
to RSS, with a logged reason, when the call fails."""

from __future__ import annotations

import errno
import logging
import os
import struct

import psutil
import pytest

from omlx.memory.budget import Limits, MemoryReading
from omlx.memory.footprint import (
    RUSAGE_INFO_V2_LAYOUT,
    ProcessFootprint,
    parse_phys_footprint,
    proc_phys_footprint,
)
from omlx.memory.mlx_stats import mlx_limits

GB = 1_000_000_000

# struct rusage_info_v2 as <sys/resource.h> declares it (macOS 10.9+).
V2_FIELDS = [
    "ri_user_time",
    "ri_system_time",
    "ri_pkg_idle_wkups",
    "ri_interrupt_wkups",
    "ri_pageins",
    "ri_wired_size",
    "ri_resident_size",
    "ri_phys_footprint",
    "ri_proc_start_abstime",
    "ri_proc_exit_abstime",
    "ri_child_user_time",
    "ri_child_system_time",
    "ri_child_pkg_idle_wkups",
    "ri_child_interrupt_wkups",
    "ri_child_pageins",
    "ri_child_elapsed_abstime",
    "ri_diskio_bytesread",
    "ri_diskio_byteswritten",
]


def rusage_v2_bytes(**values: int) -> bytes:
    """A kernel-shaped struct: 16-byte uuid, then each field as a little-endian
    uint64 (Apple Silicon), every field distinct so a wrong offset shows."""
    fields = [values.get(name, 1000 + i) for i, name in enumerate(V2_FIELDS)]
    return bytes(range(16)) + b"".join(struct.pack("<Q", v) for v in fields)


def test_the_struct_matches_the_public_header() -> None:
    raw = rusage_v2_bytes()
    # rusage_info_v2 is 160 bytes; ri_phys_footprint sits at offset 72.
    assert len(raw) == RUSAGE_INFO_V2_LAYOUT.size == 160
    assert raw[72:80] == struct.pack("<Q", 1007)


def test_phys_footprint_is_read_not_the_resident_size() -> None:
    raw = rusage_v2_bytes(ri_resident_size=3 * GB, ri_phys_footprint=7 * GB)
    assert parse_phys_footprint(raw) == 7 * GB
    # The kernel may write a longer (newer) struct into the buffer: v2's prefix counts.
    assert parse_phys_footprint(raw + bytes(352)) == 7 * GB


def test_a_short_buffer_is_an_error_not_a_wrong_number() -> None:
    with pytest.raises(ValueError, match="160 bytes"):
        parse_phys_footprint(rusage_v2_bytes()[:100])


def test_linux_reads_rss_where_there_is_no_footprint() -> None:
    if os.uname().sysname == "Darwin":
        pytest.skip("macOS reads phys_footprint")
    footprint = ProcessFootprint.for_this_platform()
    assert footprint.source == "rss"
    me = psutil.Process()
    assert abs(footprint.bytes_of(me) - me.memory_info().rss) < 64 * 1024 * 1024
    with pytest.raises(OSError):  # no libproc here: the macOS call fails cleanly
        proc_phys_footprint(os.getpid())


def test_a_platform_reading_is_used_when_it_works() -> None:
    raw = rusage_v2_bytes(ri_phys_footprint=5 * GB)
    footprint = ProcessFootprint(lambda pid: parse_phys_footprint(raw))
    assert footprint.source == "phys_footprint"
    assert footprint.bytes_of(psutil.Process()) == 5 * GB


def test_a_failing_call_falls_back_to_rss_and_says_why_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def denied(pid: int) -> int:
        raise OSError(errno.EPERM, f"proc_pid_rusage({pid}): {os.strerror(errno.EPERM)}")

    footprint = ProcessFootprint(denied)
    me = psutil.Process()
    with caplog.at_level(logging.WARNING, logger="omlx.memory.footprint"):
        first = footprint.bytes_of(me)
        footprint.bytes_of(me)
    assert abs(first - me.memory_info().rss) < 64 * 1024 * 1024
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "phys_footprint" in lines[0] and "RSS" in lines[0]
    assert "Operation not permitted" in lines[0]


def test_mlx_cache_counts_in_what_is_held() -> None:
    # The footprint missed the cache (RSS on a Mac): MLX's own sum is the floor.
    missed = MemoryReading(4 * GB, 5 * GB, 0, 0.0, mlx_cache_bytes=2 * GB)
    assert missed.resident_bytes == 6 * GB
    # The footprint holds it already (phys_footprint): never counted twice.
    held = MemoryReading(4 * GB, 7 * GB, 0, 0.0, mlx_cache_bytes=2 * GB)
    assert held.resident_bytes == 7 * GB


def test_mlx_limits_follow_the_hard_limit() -> None:
    memory, cache = mlx_limits(Limits(20 * GB, 17 * GB, GB))
    assert memory == 20 * GB
    assert cache == 3 * GB  # the band between the soft and hard limits


def test_cpu_backend_leaves_mlx_limits_unset_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import mlx.core as mx

    from omlx.memory.mlx_stats import apply_limits

    if mx.metal.is_available():
        pytest.skip("Metal sets the limits")
    before = mx.get_memory_limit()
    with caplog.at_level(logging.INFO, logger="omlx.memory.mlx_stats"):
        apply_limits(Limits(20 * GB, 17 * GB, GB))
    assert mx.get_memory_limit() == before
    assert any("CPU backend" in r.getMessage() for r in caplog.records)
