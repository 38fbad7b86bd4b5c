"""An omlx.app layout started the way py2app 0.28 starts it, for tests on any POSIX host.

``Contents/Resources/__boot__.py`` is py2app's own: its bootstrap pieces and the
prescripts of the recipes that apply to our package set, assembled by py2app's
command and recipe machinery (tests/app/py2app_boot.py), with the recipes'
resources (ssl's ``openssl.ca``) and bundle.toml's laid out as py2app lays them
out. Two pieces stand in for py2app's, which are Mach-O programs:

- ``Contents/MacOS/omlx``: its C launcher (``py2app/apptemplate/src/main.c``),
  which cannot run here. It exports what main.c exports (RESOURCEPATH, ARGVZERO,
  EXECUTABLEPATH, PYTHONDONTWRITEBYTECODE, PYTHONUNBUFFERED), sets ``sys.argv`` to
  ``[__boot__.py, *args]`` and runs the boot file with CPython's own
  ``PyRun_SimpleFileExFlags`` (through ctypes), as main.c does. When that call
  fails (the main script raised anything but SystemExit) the real launcher shows
  its modal "fatal error" alert and returns -1; this one prints ALERT_MARKER and
  exits 255 instead.
- ``Contents/MacOS/python``: the bundle's bare interpreter, ``sys.executable``;
  here a link to this host's CPython.

The bundle carries its libraries and main.c points PYTHONHOME / PYTHONPATH at
them; here they are this checkout and this venv's (``bundle_env`` puts them on
PYTHONPATH, which both programs and every child inherit, as in the bundle).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tomllib
from pathlib import Path

from tests.app.py2app_boot import copy_resource, layout_boot_files

ROOT = Path(__file__).resolve().parents[2]
ALERT_MARKER = "py2app-launcher: fatal error alert (the main script raised)"

STUB = """#!/bin/sh
here="$(cd "$(dirname "$0")" && pwd)"
export RESOURCEPATH="$here/../Resources" ARGVZERO="$0" EXECUTABLEPATH="$here/omlx"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
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
    boot = layout_boot_files()
    (resources / "__boot__.py").write_text(boot.source)
    shutil.copy(ROOT / "packaging" / "app_main.py", resources / "app_main.py")
    config = tomllib.loads((ROOT / "packaging" / "bundle.toml").read_text(encoding="utf-8"))
    for name in config["app"]["resources"]:  # folders keep their name
        copy_resource(str(ROOT / name), resources / Path(name).name)
    for source, dest in boot.resources:
        copy_resource(source, resources / dest)
    return launcher


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
