"""Files omlx writes are the user's alone: KV blocks are derived from prompts and
logs describe requests, so folders are 0700 and files 0600.

A umask set once at process start covers everything, libraries' files included
(logging's rotation, MLX's compiled kernels, model imports); the few places that
create sensitive files also pass explicit modes, so they stay private when omlx
runs as a library under someone else's umask.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600


def restrict_umask() -> None:
    """New files and folders of this process (and its children) get no group/other bits."""
    os.umask(PRIVATE_UMASK)


def make_private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents as 0700 (``Path.mkdir`` would give the
    parents the umask's mode); existing folders are left as they are."""
    missing = [p for p in (path, *path.parents) if not p.is_dir()]
    for folder in reversed(missing):
        folder.mkdir(mode=DIR_MODE, exist_ok=True)
    return path


def tighten_base_dir(path: Path) -> int | None:
    """Make omlx's own data folder 0700 when it is ours and looser; returns the old mode.

    Closing the base folder closes everything under it, including files an older
    omlx wrote under a looser umask. The home folder (or one of its parents) is
    never changed: a user who points ``--base-path`` there shares it with more than omlx.
    """
    try:
        info = path.stat()
        home = Path.home().resolve()
        resolved = path.resolve()
    except (OSError, RuntimeError):
        return None
    old_mode = stat.S_IMODE(info.st_mode)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or not old_mode & 0o077
        or home.is_relative_to(resolved)
    ):
        return None
    try:
        path.chmod(DIR_MODE)
    except OSError as exc:
        log.warning("cannot make %s private (chmod 0700): %s", path, exc)
        return None
    return old_mode
