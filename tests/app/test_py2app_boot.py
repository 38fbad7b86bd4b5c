"""The frozen layout's boot is py2app 0.28.10's: same pieces, same order, written the
same way (tests/app/py2app_boot.py), so the two cannot drift apart."""

from __future__ import annotations

import inspect
import os
import tomllib
from pathlib import Path

import py2app
import pytest

from tests.app.frozen_layout import ROOT, make_bundle
from tests.app.py2app_boot import (
    boot_files,
    full_graph,
    layout_boot_files,
    py2app_command,
    quiet,
)


def test_the_installed_py2app_is_the_one_the_build_pins() -> None:
    build = tomllib.loads((ROOT / "packaging" / "bundle.toml").read_text(encoding="utf-8"))
    assert py2app.__version__ == build["build"]["py2app"]


@pytest.mark.skipif(
    os.environ.get("OMLX_LONG") != "1",
    reason="scans the app's whole import graph (about 4 CPU minutes): the long run "
    "(OMLX_LONG=1) and after `build.py lock` changes the package set",
)
def test_the_layout_boots_what_py2app_builds_from_the_whole_app(tmp_path: Path) -> None:
    # The whole graph py2app's run_normal scans for our bundle.toml (minutes here).
    cmd = py2app_command(tmp_path / "dist")
    whole = boot_files(cmd, full_graph(cmd))
    layout = layout_boot_files()
    assert layout.pieces == whole.pieces
    assert layout.resources == whole.resources
    # What the issue is about: the multiprocessing prescript, before the app runs.
    assert whole.pieces[:4] == ("reset_sys_path", "chdir_resource", "disable_linecache", "boot_app")
    assert "multiprocessing" in whole.recipes
    assert "def _boot_multiprocessing" in whole.pieces
    bundle_boot = make_bundle(tmp_path).parent.parent / "Resources" / "__boot__.py"
    assert bundle_boot.read_text() == layout.source
    assert layout.source.endswith("DEFAULT_SCRIPT='app_main.py'\nSCRIPT_MAP={}\n_run()\n")


def test_the_boot_file_is_written_as_py2app_writes_it() -> None:
    # boot_source copies these statements of build_executable, in this order.
    with quiet():
        from py2app.build_app import py2app as command

    source = inspect.getsource(command.build_executable)
    statements = [
        "for fn in target.prescripts:",
        "bootfile.write(self.get_bootstrap_data(fn))",
        'bootfile.write("\\n\\n")',
        'bootfile.write("DEFAULT_SCRIPT=%r\\n" % (os.path.basename(script),))',
        'bootfile.write("SCRIPT_MAP=%r\\n" % (script_map,))',
        'bootfile.write("_run()\\n")',
    ]
    where = [source.find(statement) for statement in statements]
    assert -1 not in where, dict(zip(statements, where, strict=True))
    assert where == sorted(where)
