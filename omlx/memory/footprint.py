"""What the OS counts against a process: ``phys_footprint`` on macOS, RSS elsewhere.

On a Mac the kernel's memory pressure (and Activity Monitor's "Memory") follow
the task's physical footprint, which counts Metal buffers that RSS can miss.
Linux has no footprint; RSS is the nearest number it offers.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
import sys
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)

# <sys/resource.h>: proc_pid_rusage flavor and struct rusage_info_v2 (macOS 10.9+):
# uint8_t ri_uuid[16] followed by 18 uint64_t fields in this order.
RUSAGE_INFO_V2 = 2
RUSAGE_INFO_V2_FIELDS = (
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
)
# Native byte order, no padding (every uint64 already sits at an 8-byte offset).
RUSAGE_INFO_V2_LAYOUT = struct.Struct("=16s" + "Q" * len(RUSAGE_INFO_V2_FIELDS))
# Room for the kernel writing a newer, longer struct than v2.
_BUFFER_BYTES = 512


def parse_phys_footprint(raw: bytes) -> int:
    """``ri_phys_footprint`` from the bytes of a ``struct rusage_info_v2``."""
    if len(raw) < RUSAGE_INFO_V2_LAYOUT.size:
        raise ValueError(f"rusage_info_v2 needs {RUSAGE_INFO_V2_LAYOUT.size} bytes, got {len(raw)}")
    fields = RUSAGE_INFO_V2_LAYOUT.unpack_from(raw)[1:]
    return int(fields[RUSAGE_INFO_V2_FIELDS.index("ri_phys_footprint")])


def proc_phys_footprint(pid: int) -> int:
    """macOS: ``pid``'s physical footprint via libproc's ``proc_pid_rusage``.
    Raises OSError (the call failed or libproc is missing)."""
    raw = ctypes.create_string_buffer(_BUFFER_BYTES)
    if _proc_pid_rusage()(pid, RUSAGE_INFO_V2, raw) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"proc_pid_rusage({pid}): {os.strerror(errno)}")
    return parse_phys_footprint(raw.raw)


_LIBPROC: Callable[[int, int, ctypes.Array[ctypes.c_char]], int] | None = None


def _proc_pid_rusage() -> Callable[[int, int, ctypes.Array[ctypes.c_char]], int]:
    global _LIBPROC
    if _LIBPROC is None:
        try:
            # libproc is part of libSystem (in the dyld shared cache, not on disk).
            fn = ctypes.CDLL("/usr/lib/libSystem.B.dylib", use_errno=True).proc_pid_rusage
        except (OSError, AttributeError) as exc:
            raise OSError(f"libproc's proc_pid_rusage is not available: {exc}") from None
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _LIBPROC = fn
    return _LIBPROC


class ProcessFootprint:
    """Bytes the OS counts against a process. ``platform_reader`` (pid -> bytes,
    raising OSError) is ``proc_phys_footprint`` on macOS and none on Linux; when it
    fails the reading falls back to RSS and says why in the log (once per cause)."""

    def __init__(self, platform_reader: Callable[[int], int] | None = None) -> None:
        self._reader = platform_reader
        self._logged: set[str] = set()
        self.source = "phys_footprint" if platform_reader is not None else "rss"

    @classmethod
    def for_this_platform(cls) -> ProcessFootprint:
        return cls(proc_phys_footprint if sys.platform == "darwin" else None)

    def bytes_of(self, process: psutil.Process) -> int:
        """Raises psutil.Error when the process is gone."""
        if self._reader is not None:
            try:
                return self._reader(process.pid)
            except (OSError, ValueError) as exc:
                self._log_fallback(process.pid, exc)
        return int(process.memory_info().rss)

    def _log_fallback(self, pid: int, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if reason in self._logged:
            return
        self._logged.add(reason)
        log.warning(
            "memguard: cannot read phys_footprint of pid %d (%s); using its RSS, which "
            "may not count Metal buffers",
            pid,
            reason,
        )


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
        return trim
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to trim with
        return None


def wired_limit_bytes(read: Callable[[], bytes] | None = None) -> int | None:
    """macOS's GPU wired limit (``sysctl iogpu.wired_limit_mb``) when a user raised
    or lowered it; None when unset (0), elsewhere, or unreadable."""
    if read is None:
        if sys.platform != "darwin":
            return None
        read = _sysctl_wired_limit_mb
    try:
        megabytes = int(read().strip() or b"0")
    except (OSError, ValueError):
        return None
    return megabytes * 1024**2 if megabytes > 0 else None


def _sysctl_wired_limit_mb() -> bytes:
    import subprocess

    try:
        done = subprocess.run(
            ["/usr/sbin/sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, timeout=5
        )
    except subprocess.SubprocessError as exc:  # a hung sysctl: no limit read
        raise OSError(str(exc)) from exc
    if done.returncode != 0:
        raise OSError(done.stderr.decode(errors="replace").strip() or "sysctl failed")
    return done.stdout


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc only).

    MLX's CPU allocator frees through malloc, whose freed pages stay resident: on
    Linux RSS would never come down after a model unloads or MLX's cache is
    cleared, and every reading would count memory the process can reuse. A Mac
    needs nothing: phys_footprint drops as Metal buffers are freed.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
