"""Uninstall's data step: what the data folder holds (for the confirmation) and its removal.

Only the data folder itself is deleted; model folders configured elsewhere
(`models.model_dirs`) are the user's and stay.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from app.platform_calls import remove_tree
from omlx.sizes import format_bytes

# The parts the confirmation names, in this order; everything else counts as "other".
PARTS = ("models", "cache", "logs")


class UninstallError(Exception):
    """The data folder was not removed; the message says why."""


@dataclass(frozen=True, slots=True)
class DataSizes:
    base_path: Path
    part_bytes: tuple[tuple[str, int], ...]  # (name, bytes) for PARTS, then "other"

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.part_bytes)

    def summary(self) -> str:
        """E.g. "models 4.2 GB, cache 1.0 GB, logs 3.1 MB, other 12.0 KB"."""
        return ", ".join(f"{name} {format_bytes(size)}" for name, size in self.part_bytes)


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (symlinks not followed, unreadable parts skipped)."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size if path.is_symlink() or path.is_file() else 0
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we counted
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def measure(base_path: Path) -> DataSizes:
    parts = [(name, folder_bytes(base_path / name)) for name in PARTS]
    other = folder_bytes(base_path) - sum(size for _, size in parts)
    return DataSizes(base_path, (*parts, ("other", max(0, other))))


def check_removable(base_path: Path) -> None:
    """Refuse a data folder whose removal would take more than omlx's data."""
    resolved = base_path.expanduser().resolve()
    if resolved in (Path.home().resolve(), Path(resolved.anchor)) or len(resolved.parts) < 3:
        raise UninstallError(f"{base_path} is not an omlx data folder: delete it by hand")
    if not resolved.is_dir():
        raise UninstallError(f"{base_path} does not exist: there is no data to delete")


def remove_data(base_path: Path) -> None:
    check_removable(base_path)
    try:
        remove_tree(base_path)
    except OSError as exc:
        raise UninstallError(f"could not delete all of {base_path}: {exc}") from None
