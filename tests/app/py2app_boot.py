"""py2app 0.28's own ``__boot__.py`` for omlx.app, assembled on any host.

py2app cannot build on Linux, but its command object, bootstrap pieces and recipes
import and run here. This drives them the way ``py2app.build_app.py2app.run``
does for our bundle.toml options (the same ``py2app_options`` the Mac build
passes): ``fixup_distribution``, ``initialize_prescripts`` (the bootstrap pieces:
``reset_sys_path``, ``chdir_resource``, ``disable_linecache``, ``boot_app``...),
then ``process_recipes`` over a modulegraph, whose recipes append their
prescripts (multiprocessing's, ctypes', ssl's...) and resources. ``boot_source``
writes them the way ``build_executable`` writes ``Contents/Resources/__boot__.py``.

The app's whole import graph takes minutes to build here, so the layout's graph
holds only RECIPE_SEED, the modules of that graph py2app's recipes key on (and what
they import, less SEED_EXCLUDES); tests/app/test_py2app_boot.py builds the whole
graph and checks both give the same boot pieces in the same order.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from io import StringIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packaging"))

from omlx_build.app_build import py2app_options  # noqa: E402
from omlx_build.project import load_config  # noqa: E402

# What the app's full graph holds that a recipe with boot code keys on (see above).
RECIPE_SEED = ("multiprocessing", "ctypes", "ssl", "pkg_resources", "PIL.Image")
# Left out of that graph: no recipe keys on numpy, which PIL.Image's optional imports
# reach; it was 622 of the graph's 1779 modules, and detect_dunder_file's walk of its
# whole package (numpy.testing's hypothesis, pytest, pygments) took it to 3108, most of
# the suite's 25 s here. Without it: 1027 modules, the same pieces and resources.
# Then the standard library's largest corners that no recipe with boot code keys on
# (pydoc's 750 KB of topics, the test and packaging tools, asyncio, email, http):
# 841 modules, 8.2 -> 5.6 CPU s, the same pieces, resources and __boot__.py.
SEED_EXCLUDES = (
    *("numpy", "pydoc", "pydoc_data", "_pydecimal", "lib2to3", "unittest", "doctest"),
    *("pdb", "test", "asyncio", "email", "http", "xmlrpc", "distutils", "tarfile"),
    *("concurrent", "difflib", "statistics"),
)
# Installed here (pywebview's Linux backend), absent from the Mac build
# (packaging/macos-requirements.txt): py2app's Qt recipes would bundle them.
NOT_IN_MAC_BUILD = ("PyQt5", "PyQt6", "PySide2", "PySide6")
# process_recipes prints each recipe it applies.
USED_RECIPE = re.compile(r"^\*\*\* using recipe: (\S+) \*\*\*", re.MULTILINE)


@dataclass(frozen=True)
class BootFiles:
    """``__boot__.py``'s text, what went into it in order, and the recipes' resources."""

    source: str
    recipes: tuple[str, ...]  # the recipes that applied, in py2app's order
    pieces: tuple[str, ...]
    resources: tuple[tuple[str, str], ...]  # (source path, path under Resources)


def py2app_command(dist_dir: Path) -> Any:
    """py2app's own command for our bundle.toml, as far as ``run`` goes before building."""
    from setuptools.dist import Distribution

    config = load_config()
    options = {**py2app_options(config), "dist_dir": str(dist_dir)}
    attrs = {"name": config.name, "version": config.version, "app": [str(config.entry)]}
    dist = Distribution({**attrs, "options": {"py2app": options}})
    with quiet():
        cmd = dist.get_command_obj("py2app")
        cmd.ensure_finalized()
        cmd.fixup_distribution()
        cmd.additional_paths = [str(config.entry.parent)]
        cmd.initialize_prescripts()
    return cmd


def seed_graph(cmd: Any) -> Any:
    from modulegraph.find_modules import find_modules

    with quiet():
        return find_modules(includes=RECIPE_SEED, excludes=[*cmd.excludes, *SEED_EXCLUDES])


def full_graph(cmd: Any) -> Any:
    """What ``run_normal`` scans: the entry script, our packages and includes (minutes)."""
    with quiet():
        return cmd.get_modulefinder()


@contextlib.contextmanager
def quiet() -> Iterator[StringIO]:
    """py2app's progress lines and modulegraph's thousands of DeprecationWarnings."""
    printed = StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
        warnings.simplefilter("ignore", DeprecationWarning)
        yield printed


@contextlib.contextmanager
def mac_build_packages() -> Iterator[None]:
    """Imports of packages the Mac build lacks fail, as they would there."""
    saved = {name: sys.modules.get(name) for name in NOT_IN_MAC_BUILD}
    sys.modules.update(dict.fromkeys(NOT_IN_MAC_BUILD))
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def boot_files(cmd: Any, graph: Any) -> BootFiles:
    """Run py2app's recipes over ``graph``; then what build_executable writes."""
    own_resources = len(cmd.resources)
    with mac_build_packages(), quiet() as printed:
        cmd.process_recipes(graph, [], {}, [])
    prescripts = cmd.targets[0].prescripts
    return BootFiles(
        source=boot_source(cmd),
        recipes=tuple(USED_RECIPE.findall(printed.getvalue())),
        pieces=tuple(piece_name(cmd, p) for p in prescripts),
        resources=tuple(recipe_resources(cmd, own_resources)),
    )


def boot_source(cmd: Any) -> str:
    # py2app/build_app.py, build_executable (0.28.10), for a target without extra scripts.
    target = cmd.targets[0]
    text = "".join(cmd.get_bootstrap_data(fn) + "\n\n" for fn in target.prescripts)
    text += f"DEFAULT_SCRIPT={os.path.basename(target.script)!r}\n"
    text += f"SCRIPT_MAP={ {}!r}\n"
    return text + "_run()\n"


def piece_name(cmd: Any, piece: Any) -> str:
    """A bootstrap module's name, or how a recipe's generated code starts (``def _f``)."""
    if isinstance(piece, str):
        path = Path(piece)
        return path.stem if path.name != "prescript.py" else f"{path.parent.name}.prescript"
    first_line = cmd.get_bootstrap_data(piece).strip().splitlines()[0]
    return re.match(r"[\w ]*", first_line).group().strip()  # type: ignore[union-attr]


def recipe_resources(cmd: Any, skip: int) -> Iterator[tuple[str, str]]:
    """The recipes' resources as py2app's ``iter_data_files`` names them."""
    from py2app.build_app import normalize_data_file

    for folder, files in map(normalize_data_file, cmd.resources[skip:]):
        for name in files:
            yield name, os.path.join(folder, os.path.basename(name))


@cache
def layout_boot_files() -> BootFiles:
    """The boot files every frozen layout gets (built once per test process)."""
    work = Path(tempfile.mkdtemp(prefix="omlx-py2app-"))
    cmd = py2app_command(work)
    try:
        return boot_files(cmd, seed_graph(cmd))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def copy_resource(source: str, dest: Path) -> None:
    """py2app's copy_resource: a folder whole (links kept), a file as is."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(source):
        shutil.copytree(source, dest, symlinks=True)
    else:
        shutil.copy(source, dest)
