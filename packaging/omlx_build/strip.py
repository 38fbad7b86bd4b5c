"""Remove packages the app never imports (torch and friends) from the bundle."""

from __future__ import annotations

import re
import shutil
from pathlib import Path


def normalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def strip_packages(site_packages: Path, names: tuple[str, ...]) -> list[str]:
    """Delete each named top-level package, module and dist-info; the names removed."""
    wanted = {normalize_name(n) for n in names}
    removed = []
    for entry in sorted(site_packages.iterdir()):
        stem = entry.name.split("-")[0] if entry.name.endswith(".dist-info") else entry.name
        stem = stem.removesuffix(".py")
        if normalize_name(stem) not in wanted:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    return removed


def strip_debug_symbols(site_packages: Path) -> list[str]:
    """Delete the .dSYM debug bundles some wheels ship (xgrammar does).

    Users never need them, and their DWARF files are Mach-O files that would otherwise
    have to be signed like code.
    """
    found = sorted(p for p in site_packages.rglob("*.dSYM") if p.is_dir())
    for path in found:
        shutil.rmtree(path)
    return [str(p.relative_to(site_packages)) for p in found]
