"""py2app's entry script for omlx.app: the shell, or `omlx` / the window when asked.

py2app's bootstrap runs it as ``__main__``. A process the app spawns through
multiprocessing (the admin panel's GGUF import, the built-in model's install)
imports it again as ``__mp_main__``: that must not start a second app.

py2app's launcher shows a modal "fatal error" alert when this script raises
(``PyRun_SimpleFile`` fails) but not on SystemExit, which CPython turns into the
process's exit status before the launcher looks. So a child (server, CLI, window,
multiprocessing) never lets an error escape: it prints the traceback to stderr,
which the shell keeps in its logs, and exits 1. The shell itself keeps the alert:
when it cannot start there is no menu to say so (``app.main`` logs it first).
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable

# argv[1] of the processes the app starts from its own launcher (see app.paths).
CHILD_FLAGS = ("--omlx-cli", "--omlx-window", "--multiprocessing-fork")
# How multiprocessing starts its resource tracker: `<executable> [flags] -c CODE`.
RESOURCE_TRACKER = re.compile(r"from multiprocessing\.resource_tracker import main;main\((\d+)\)")


def is_child(argv: list[str]) -> bool:
    return (len(argv) > 1 and argv[1] in CHILD_FLAGS) or _tracker_fd(argv) is not None


def _tracker_fd(argv: list[str]) -> int | None:
    if len(argv) < 3 or argv[-2] != "-c":
        return None
    match = RESOURCE_TRACKER.fullmatch(argv[-1])
    return int(match.group(1)) if match else None


def run_child(entry: Callable[[], int | None]) -> None:
    """Exit with ``entry()``'s status; an uncaught error exits 1, never to the alert."""
    try:
        status = entry()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException:  # whatever it was, its traceback is the report
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
    sys.exit(status)


def child_main() -> int | None:
    from multiprocessing import resource_tracker, spawn

    tracker_fd = _tracker_fd(sys.argv)
    if tracker_fd is not None:
        resource_tracker.main(tracker_fd)
        return 0
    spawn.freeze_support()  # a `--multiprocessing-fork` child runs its target and exits here
    from app.main import main

    return main()


def use_launcher_for_children() -> None:
    # Frozen, multiprocessing starts a child as `sys.executable --multiprocessing-fork`
    # (exec'ing its own executable setting), and py2app's sys.executable is the
    # bundle's bare interpreter (Contents/MacOS/python), which refuses that flag. Our
    # own launcher (py2app exports its path) takes it: child_main() runs it.
    from multiprocessing import spawn

    launcher = os.environ.get("EXECUTABLEPATH")
    if getattr(sys, "frozen", False) and launcher:
        sys.executable = launcher
        spawn.set_executable(launcher)


if __name__ == "__main__":
    use_launcher_for_children()
    if is_child(sys.argv):
        run_child(child_main)
    try:
        from app.main import main

        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C in a terminal is no crash
        sys.exit(130)
