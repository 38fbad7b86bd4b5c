"""Packages copied into the bundle whole, layout kept, after py2app has run.

mlx is why: it is a namespace package (its wheels ship no ``mlx/__init__.py``, and
mlx-metal adds ``mlx/lib/`` to the same folder), which py2app's package lookup cannot
find, and MLX loads ``mlx.metallib`` from beside its own ``libmlx.dylib``, which
py2app's dylib collection would move into Contents/Frameworks. A plain copy keeps the
``@rpath``/``@loader_path`` links between ``mlx/core*.so`` and ``mlx/lib`` intact.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from importlib import metadata
from importlib.machinery import PathFinder
from pathlib import Path

from omlx_build.project import BuildError

_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


def package_dirs(name: str, search_path: Sequence[str] | None = None) -> list[Path]:
    """Every folder that makes up package ``name`` (several for a namespace package)."""
    spec = PathFinder.find_spec(name, list(search_path or sys.path))
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(f"package {name!r} is not installed in the build environment")
    return [Path(p) for p in spec.submodule_search_locations]


def dist_info_dirs(name: str, search_path: Sequence[str] | None = None) -> list[Path]:
    """The .dist-info folders of every distribution that installs files into ``name``."""
    found = []
    for dist in metadata.distributions(path=list(search_path or sys.path)):
        files = dist.files or []
        if any(f.parts[:1] == (name,) for f in files):
            found += [Path(str(dist.locate_file(f))).parent for f in files if f.name == "METADATA"]
    return sorted(set(found))


def copy_whole(name: str, dest_site: Path, search_path: Sequence[str] | None = None) -> Path:
    """Copy package ``name`` and its distributions' metadata into ``dest_site``.

    The metadata keeps ``importlib.metadata.version("mlx")`` working in the bundle.
    A namespace package's folders are merged into one.
    """
    target = dest_site / name
    if target.exists():
        # Whatever py2app put there (it should be nothing: the package is excluded).
        shutil.rmtree(target)
    for folder in package_dirs(name, search_path):
        shutil.copytree(folder, target, symlinks=True, ignore=_SKIP, dirs_exist_ok=True)
    for info in dist_info_dirs(name, search_path):
        shutil.copytree(info, dest_site / info.name, dirs_exist_ok=True)
    return target
