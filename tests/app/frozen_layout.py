"""An omlx.app layout started the way py2app 0.28 starts it, for tests on any POSIX host.

The pieces stand in for py2app's:

- ``Contents/MacOS/omlx``: its C launcher. It exports RESOURCEPATH, ARGVZERO and
  EXECUTABLEPATH, sets ``sys.argv`` to ``[__boot__.py, *args]`` and runs the
  bootstrap with CPython's own ``PyRun_SimpleFileExFlags`` (through ctypes), as
  ``py2app/apptemplate/src/main.c`` does. When that call fails (the main script
  raised anything but SystemExit) the real launcher shows its modal "fatal error"
  alert and returns -1; this one prints ALERT_MARKER and exits 255 instead.
- ``Contents/MacOS/python``: the bare interpreter, which is ``sys.executable``.
- ``Resources/__boot__.py``: py2app's ``boot_app._run``: sets ``sys.frozen`` and runs
  ``Resources/app_main.py`` in ``__main__`` with ``sys.argv[0]`` pointing at it.

The bundle carries its libraries; here they are this checkout and this venv's
(``bundle_env`` puts them on PYTHONPATH).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALERT_MARKER = "py2app-launcher: fatal error alert (the main script raised)"

STUB = """#!/bin/sh
here="$(cd "$(dirname "$0")" && pwd)"
export RESOURCEPATH="$here/../Resources" ARGVZERO="$0" EXECUTABLEPATH="$here/omlx"
exec "$here/python" "$RESOURCEPATH/__launcher__.py" "$@"
"""
# main.c: PySys_SetArgv([mainScript, argv[1:]]); rval = PyRun_SimpleFile(...);
# if (rval) rval = report_script_error(ERR_PYTHONEXCEPTION); ... return rval;
LAUNCHER = f"""import ctypes, os, sys


def launch():
    boot = os.path.join(os.environ["RESOURCEPATH"], "__boot__.py")
    sys.argv[:] = [boot, *sys.argv[1:]]
    libc = ctypes.CDLL(None)
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fopen.restype = ctypes.c_void_p
    run = ctypes.pythonapi.PyRun_SimpleFileExFlags
    run.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p]
    failed = run(libc.fopen(boot.encode(), b"r"), boot.encode(), 1, None)
    if failed:
        stderr = sys.__stderr__
        stderr.write({ALERT_MARKER!r} + "\\n")
        stderr.flush()
        os._exit(255)


launch()
"""
BOOT = """import os
import sys


def _run():
    global __file__
    sys.frozen = "macosx_app"
    path = os.path.join(os.environ["RESOURCEPATH"], DEFAULT_SCRIPT)
    sys.argv[0] = __file__ = path
    with open(path, encoding="utf-8") as fp:
        source = fp.read() + "\\n"
    exec(compile(source, path, "exec"), globals(), globals())


DEFAULT_SCRIPT = "app_main.py"
SCRIPT_MAP = {}
_run()
"""


def make_bundle(root: Path) -> Path:
    """``root/omlx.app``; returns its launcher, ``Contents/MacOS/omlx``."""
    contents = root / "omlx.app" / "Contents"
    (contents / "MacOS").mkdir(parents=True)
    resources = contents / "Resources"
    resources.mkdir()
    launcher = contents / "MacOS" / "omlx"
    launcher.write_text(STUB)
    launcher.chmod(0o755)
    (contents / "MacOS" / "python").symlink_to(os.path.realpath(sys.executable))
    (resources / "__launcher__.py").write_text(LAUNCHER)
    (resources / "__boot__.py").write_text(BOOT)
    shutil.copy(ROOT / "packaging" / "app_main.py", resources / "app_main.py")
    copy_resources(resources)
    return launcher


def copy_resources(resources: Path) -> None:
    """What bundle.toml's ``resources`` puts in Contents/Resources (folders keep their name)."""
    config = tomllib.loads((ROOT / "packaging" / "bundle.toml").read_text(encoding="utf-8"))
    for name in config["app"]["resources"]:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, resources / source.name)
        else:
            shutil.copy(source, resources / source.name)


def bundle_env(*first: Path) -> dict[str, str]:
    """The environment the bundle runs with: its libraries (``first`` ahead of them)."""
    libs = [*map(str, first), str(ROOT), sysconfig.get_paths()["purelib"]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(libs)}


def broken_package(root: Path, name: str, error: str) -> Path:
    """A folder to put ahead of the bundle's libraries, where ``name`` fails to import."""
    package = root / "broken" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError({error!r})\n")
    return root / "broken"
