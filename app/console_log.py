"""A child process's console output, copied line by line into a size-rotated log file.

The server and window children write to a pipe, not straight to the file: a child holds
its file descriptor for its whole run, so a file it writes to directly can be neither
rotated nor bounded. logging's RotatingFileHandler does the rotation.
"""

from __future__ import annotations

import logging
import logging.handlers
import threading
from pathlib import Path
from typing import IO

MAX_BYTES = 2_000_000
BACKUPS = 3
# A line longer than this is split: one runaway write must not take the shell's memory.
MAX_LINE = 64 * 1024


class ConsoleLog:
    def __init__(self, path: Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=True
        )
        self._handler.terminator = ""  # the lines keep their own newlines
        self._readers: list[threading.Thread] = []

    def copy_from(self, stream: IO[bytes], name: str) -> None:
        """Copy ``stream`` (a child's stdout/stderr pipe) until EOF, on a daemon thread."""
        reader = threading.Thread(
            target=self._copy, args=(stream,), name=f"omlx-console-{name}", daemon=True
        )
        self._readers = [t for t in self._readers if t.is_alive()] + [reader]
        reader.start()

    def wait(self, timeout_s: float = 2.0) -> None:
        """Let the readers write what the children left (a grandchild may keep a pipe open)."""
        for reader in self._readers:
            reader.join(timeout_s)

    def close(self) -> None:
        self._handler.close()

    def _copy(self, stream: IO[bytes]) -> None:
        with stream:
            for raw in iter(lambda: stream.readline(MAX_LINE), b""):
                self.write(raw.decode("utf-8", "replace"))

    def write(self, line: str) -> None:
        # A progress bar redraws one line with \r: keep what a terminal would show last.
        shown = line.rstrip("\n").rsplit("\r", 1)[-1]
        self._handler.handle(logging.makeLogRecord({"msg": shown + "\n", "args": None}))


def tail_line(path: Path, max_bytes: int = 4096) -> str:
    """The last non-empty line of ``path`` ("" if there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - max_bytes))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""
