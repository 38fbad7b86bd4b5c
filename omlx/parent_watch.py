"""`omlx serve --parent-fd FD`: the server stops when the program that started it is gone.

The desktop app starts the server in its own session (so a terminal's Ctrl-C reaches the
app, which stops the server in order) and passes it the read end of a pipe whose write
end only the app holds. When the app exits, crashes or is force-quit, the kernel closes
that write end and a read here returns EOF: on macOS and Linux alike, no polling, no pid
reuse races. The server then shuts down as on Ctrl-C, within a bound.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time

from omlx.errors import SettingsError

log = logging.getLogger("omlx")

# uvicorn drains connections for 5 s; the worker and engines then close. Past this the
# process exits anyway: a server nobody can reach must not keep holding model memory.
GRACE_S = 30.0


def check_parent_fd(fd: int) -> None:
    """Refuse an fd that is not an open pipe (a typo would otherwise never fire)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        raise SettingsError(f"--parent-fd {fd} is not an open file descriptor") from None
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        raise SettingsError(f"--parent-fd {fd} is not a pipe; pass the read end of a pipe")


def watch_parent(fd: int, grace_s: float = GRACE_S) -> threading.Thread:
    """Start a daemon thread that stops this process once ``fd`` reaches EOF."""
    check_parent_fd(fd)
    thread = threading.Thread(
        target=_wait_then_stop, args=(fd, grace_s), name="omlx-parent-watch", daemon=True
    )
    thread.start()
    return thread


def _wait_then_stop(fd: int, grace_s: float) -> None:
    try:
        while os.read(fd, 4096):  # the parent never writes; data is ignored, EOF is the news
            pass
    except OSError as exc:
        log.warning("parent watch on fd %d failed (%s): stopping", fd, exc)
    log.warning("the app that started this server went away: shutting down")
    # SIGINT, as the app's own stop sends: uvicorn shuts down gracefully and Server.run
    # stops the worker. (After a SIGTERM uvicorn re-raises it and the worker's stop is
    # skipped.) Before uvicorn runs, SIGINT interrupts start-up with KeyboardInterrupt.
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(grace_s)
    log.error("server did not stop %g s after its app went away: exiting now", grace_s)
    logging.shutdown()
    os._exit(1)
