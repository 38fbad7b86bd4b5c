"""Remove packages the app never imports (torch and friends) from the bundle."""

from __future__ import annotations

import re
import shutil
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def strip_packages(site_packages: Path, names: tuple[str, ...]) -> list[str]:
    """Delete each named top-level package, module and dist-info; the names removed."""
    wanted = {_norm(n) for n in names}
    removed = []
    for entry in sorted(site_packages.iterdir()):
        stem = entry.name.split("-")[0] if entry.name.endswith(".dist-info") else entry.name
        stem = stem.removesuffix(".py")
        if _norm(stem) not in wanted:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    return removed
