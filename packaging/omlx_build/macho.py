"""Mach-O files in a folder: which files they are, in signing order, and their minimum macOS.

`is_macho` reads magic bytes only, so it finds compiled code under any name (a helper
binary without .so/.dylib still has to be signed); `min_macos` parses load commands with
macholib (py2app's own Mach-O library).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from macholib.mach_o import (
    LC_BUILD_VERSION,
    LC_VERSION_MIN_MACOSX,
    PLATFORM_MACOS,
)
from macholib.MachO import MachO

# Thin headers, both byte orders, read as a big-endian word: MH_MAGIC, MH_CIGAM,
# MH_MAGIC_64, MH_CIGAM_64.
_THIN_MAGICS = {0xFEEDFACE, 0xCEFAEDFE, 0xFEEDFACF, 0xCFFAEDFE}
# Universal ("fat") headers are always big-endian: FAT_MAGIC, FAT_MAGIC_64.
_FAT_MAGICS = {0xCAFEBABE, 0xCAFEBABF}
# Java class files share 0xcafebabe; their next word is the class version (>= 45),
# while a universal binary's is its slice count. Apple's `file` draws the line at 20.
_MAX_FAT_ARCHS = 20
CPU_TYPE_ARM64 = 0x0100000C


def is_macho(path: Path) -> bool:
    """True for a thin or universal Mach-O file, judged by its first eight bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return False
    if len(head) < 8:
        return False
    magic = int.from_bytes(head[:4], "big")
    if magic in _THIN_MAGICS:
        return True
    if magic in _FAT_MAGICS:
        return 0 < int.from_bytes(head[4:8], "big") < _MAX_FAT_ARCHS
    return False


def regular_files(root: Path) -> list[Path]:
    """Every regular file under root; symlinks (to files or folders) are not followed."""
    found = []
    for folder, _dirs, names in os.walk(root, followlinks=False):
        for name in names:
            path = Path(folder, name)
            if stat.S_ISREG(path.lstat().st_mode):
                found.append(path)
    return found


def macho_files(root: Path) -> list[Path]:
    """Every Mach-O file under root, deepest first then by name: the inside-out signing order.

    codesign seals nested code into the signature of what contains it, so a library must
    be signed before anything that lives above it in the tree.
    """
    found = [path for path in regular_files(root) if is_macho(path)]
    return sorted(found, key=lambda p: (-len(p.parts), str(p)))


def _format_version(encoded: int) -> str:
    """Mach-O versions are nibble-packed xxxx.yy.zz; "14.0" or "14.0.1"."""
    major, minor, patch = encoded >> 16, (encoded >> 8) & 0xFF, encoded & 0xFF
    return f"{major}.{minor}.{patch}" if patch else f"{major}.{minor}"


def min_macos(path: Path) -> str | None:
    """The minimum macOS of the file's arm64 slice; None when it has no arm64 slice or no
    version load command."""
    for header in MachO(str(path)).headers:
        if header.header.cputype != CPU_TYPE_ARM64:
            continue
        for load_command, command, _data in header.commands:
            if load_command.cmd == LC_BUILD_VERSION and command.platform == PLATFORM_MACOS:
                return _format_version(command.minos)
            if load_command.cmd == LC_VERSION_MIN_MACOSX:
                return _format_version(command.version)
    return None


def parses_as_macho(path: Path) -> bool:
    """Whether macholib reads the file as Mach-O: a check independent of `is_macho`."""
    try:
        MachO(str(path))
    # macholib reports a non-Mach-O file by whatever its struct reads hit (ValueError,
    # struct.error, EOFError, ...): any failure means "not a Mach-O file".
    except Exception:
        return False
    return True
