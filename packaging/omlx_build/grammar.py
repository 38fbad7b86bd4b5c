"""xgrammar + apache-tvm-ffi into the bundle without torch, guarded by a versioned sentinel.

The sentinel is the only proof of a finished install. It is removed before installing,
written last (temp file + rename, so never half-written) and only after the package roots
exist with non-zero size: an interrupted or truncated install is never taken as done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from omlx_build.project import BuildError

SENTINEL = ".omlx-grammar-installed.json"
SENTINEL_FORMAT = 1
# The file whose presence and size show a package was really unpacked.
PACKAGE_ROOTS = {"xgrammar": "xgrammar/__init__.py", "apache-tvm-ffi": "tvm_ffi/__init__.py"}

Installer = Callable[[Path, Sequence[str]], None]


def pip_installer(python: str = sys.executable, extra_args: Sequence[str] = ()) -> Installer:
    """`pip install --no-deps --target`: the packages declare torch/triton, which we never want."""

    def install(target: Path, requirements: Sequence[str]) -> None:
        cmd = [python, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(target)]
        subprocess.run([*cmd, *extra_args, *requirements], check=True)

    return install


def _payload(pins: dict[str, str]) -> dict[str, object]:
    return {"format": SENTINEL_FORMAT, "packages": dict(sorted(pins.items()))}


def root_problems(site_packages: Path) -> list[str]:
    problems = []
    for package, rel in PACKAGE_ROOTS.items():
        path = site_packages / rel
        if not path.is_file():
            problems.append(f"{package}: {rel} is missing")
        elif path.stat().st_size == 0:
            problems.append(f"{package}: {rel} is empty (truncated install)")
    return problems


def is_installed(site_packages: Path, pins: dict[str, str]) -> bool:
    """True only for a sentinel of exactly these versions over intact package roots."""
    try:
        recorded = json.loads((site_packages / SENTINEL).read_text())
    except (OSError, ValueError):
        return False
    return recorded == _payload(pins) and not root_problems(site_packages)


def write_sentinel(site_packages: Path, pins: dict[str, str]) -> None:
    final = site_packages / SENTINEL
    tmp = final.with_name(final.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(_payload(pins), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def install_grammar(site_packages: Path, pins: dict[str, str], installer: Installer) -> bool:
    """Install the pinned packages unless already done; True if it installed now."""
    if is_installed(site_packages, pins):
        return False
    site_packages.mkdir(parents=True, exist_ok=True)
    # An old sentinel must not vouch for a new install that is about to be interrupted.
    (site_packages / SENTINEL).unlink(missing_ok=True)
    installer(site_packages, [f"{name}=={version}" for name, version in sorted(pins.items())])
    problems = root_problems(site_packages)
    if problems:
        raise BuildError("grammar packages incomplete after install: " + "; ".join(problems))
    write_sentinel(site_packages, pins)
    return True
