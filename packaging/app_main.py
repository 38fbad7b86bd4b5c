"""py2app's entry script for omlx.app: the shell, or `omlx` / the window when asked.

A py2app bundle has two programs in ``Contents/MacOS``. ``omlx`` is py2app's C
launcher: whatever its arguments, it runs ``Resources/__boot__.py`` (py2app's
bootstrap pieces and recipe prescripts, ``sys.frozen`` set, the working directory
moved to Resources) and then this script. ``python`` is a plain CPython on the
same libraries (it inherits the PYTHONHOME / PYTHONPATH the launcher exports), and
py2app makes it ``sys.executable``.

One rule for every child the app starts: the launcher runs the app, ``python``
runs Python.

- The launcher: the shell (no arguments, or the shell's own ``--options``), the
  server and CLI (``--omlx-cli ARGS``: ``omlx ARGS``), the admin window
  (``--omlx-window ARGS``); app.paths builds those commands from EXECUTABLEPATH.
- ``python`` (``sys.executable``, left as py2app sets it): multiprocessing's
  children, which py2app's multiprocessing recipe starts as ``python -B -c
  "...spawn_main(...)" --multiprocessing-fork``, and its resource tracker
  (``python -B -c "...resource_tracker import main;main(FD)"``); the ``python -m``
  workers (Hub downloads and ``omlx pull``, oQ, the MLX JIT probe); any ``-c``.

Why not run Python's command line on the launcher instead: this script would have
to re-implement CPython's option parsing (multiprocessing copies ``-B -E -s -O -W
-X ...`` from ``sys.flags``) and put every worker through the app's boot, a second
interpreter that drifts from the real one. ``python`` already takes them all.

So a launcher argv that is a Python command line (``-c``, ``-m``, any
interpreter option, ``--multiprocessing-fork`` anywhere) is a bug: it exits 2 with
a message naming the argv, and never reaches the shell's argument parser.

A spawned child imports this script again as ``__mp_main__``: that must not start
a second app (everything below is under ``__name__ == "__main__"``).

py2app's launcher shows a modal "fatal error" alert when this script raises
(``PyRun_SimpleFile`` fails) but not on SystemExit, which CPython turns into the
process's exit status before the launcher looks. So a child (server, CLI, window)
never lets an error escape: it prints the traceback to stderr, which the shell
keeps in its logs, and exits 1. The shell itself keeps the alert: when it cannot
start there is no menu to say so (``app.main`` logs it first).
"""

from __future__ import annotations

import shlex
import sys
import traceback
from collections.abc import Callable

# argv[1] of the processes the app starts on its own launcher (see app.paths).
CHILD_FLAGS = ("--omlx-cli", "--omlx-window")
# How multiprocessing marks a spawned child's command line (anywhere in it).
FORK_FLAG = "--multiprocessing-fork"
NOT_PYTHON = (
    "omlx: the omlx.app launcher runs the app, not Python: got {argv}. Python "
    "programs (multiprocessing, `-m` workers, `-c`) run on the bundle's "
    "interpreter, sys.executable (Contents/MacOS/python)."
)


def is_child(argv: list[str]) -> bool:
    return len(argv) > 1 and argv[1] in CHILD_FLAGS


def is_python_command_line(argv: list[str]) -> bool:
    """An interpreter's argv (``-c``, ``-m``, ``-B``, a script...), not the shell's.

    The shell's own options are all ``--long``; the interpreter's are single-dash.
    """
    args = argv[1:]
    if not args or is_child(argv):
        return False
    return FORK_FLAG in args or not args[0].startswith("--")


def refuse_python_command_line(argv: list[str]) -> None:
    sys.stderr.write(NOT_PYTHON.format(argv=shlex.join(argv[1:])) + "\n")
    sys.stderr.flush()
    sys.exit(2)


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


def app_entry() -> int | None:
    from app.main import main

    return main()


if __name__ == "__main__":
    if is_python_command_line(sys.argv):
        refuse_python_command_line(sys.argv)
    if is_child(sys.argv):
        run_child(app_entry)
    try:
        sys.exit(app_entry())
    except KeyboardInterrupt:  # Ctrl-C in a terminal is no crash
        sys.exit(130)
