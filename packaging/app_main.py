"""py2app's entry script for omlx.app: the shell, or `omlx` / the window when asked.

py2app's bootstrap runs it as ``__main__``. A process the app spawns through
multiprocessing (the admin panel's GGUF import, the built-in model's install)
imports it again as ``__mp_main__``: that must not start a second app.
"""

import os
import sys

if __name__ == "__main__":
    from multiprocessing import spawn

    # Frozen, multiprocessing starts a child as `sys.executable --multiprocessing-fork`
    # (exec'ing its own executable setting), and py2app's sys.executable is the
    # bundle's bare interpreter (Contents/MacOS/python), which refuses that flag. Our
    # own launcher (py2app exports its path) takes it: freeze_support() below runs
    # the child's target there and exits.
    launcher = os.environ.get("EXECUTABLEPATH")
    if getattr(sys, "frozen", False) and launcher:
        sys.executable = launcher
        spawn.set_executable(launcher)
    spawn.freeze_support()

    from app.main import main

    sys.exit(main())
