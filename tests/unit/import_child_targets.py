"""Functions the import-child tests run in a spawned process.

Kept apart from the test module so the child imports nothing heavy (no mlx).
"""

from __future__ import annotations

import os
import signal
import time

from omlx.errors import ImportFailedError


def allocate(num_bytes: int) -> int:
    return len(bytearray(num_bytes))


def refuse(message: str) -> None:
    raise ImportFailedError(message, param="path")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hold_memory(num_bytes: int, seconds: float) -> int:
    block = b"x" * num_bytes  # every page written, so it is resident
    time.sleep(seconds)
    return len(block)
