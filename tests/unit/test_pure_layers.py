"""The import facts of docs/ARCHITECTURE.md hold: its generated section is what an AST
scan of omlx/ finds (edges between the parts, the modules that import MLX), and the
pure layers import no MLX, checked statically and in a fresh interpreter, so the
scheduler, the prefix index, the step's memory rules and the execution strategy run
and test without it, and admission never waits on an MLX import."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.import_map import (
    MAP,
    PURE,
    ImportScan,
    When,
    current_section,
    render,
)


@pytest.fixture(scope="module")
def scan() -> ImportScan:
    return ImportScan()


def test_the_map_s_import_section_is_what_the_code_imports(scan: ImportScan) -> None:
    written = current_section(MAP.read_text(encoding="utf-8"))
    assert written, f"{MAP.name} has lost its generated import-map section"
    wanted = render(scan)
    diff = "\n".join(difflib.unified_diff(written.splitlines(), wanted.splitlines(), lineterm=""))
    assert written == wanted, (
        f"{MAP.name} and the code differ on imports; if the code is right, run "
        f"`python -m tests.fixtures.import_map` and review the map's diff:\n{diff}"
    )


def test_pure_layers_reach_no_mlx_through_their_module_level_imports(scan: ImportScan) -> None:
    modules = scan.expand(PURE)
    assert len(modules) >= len(PURE), "a pure module named in PURE no longer exists"
    chains = {m: chain for m in modules if (chain := scan.chain_to_mlx(m))}
    assert not chains, "\n".join(" -> ".join(chain) for chain in chains.values())


def test_the_scan_tells_an_import_at_import_from_a_deferred_or_typing_one(
    tmp_path: Path,
) -> None:
    """A new edge or a new MLX import shows up in the section (so the check above
    fails until the map says so), each at the earliest time it runs."""
    package = tmp_path / "omlx"
    for sub in ("core", "edge"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "floor_mod.py").write_text("")
    (package / "core" / "plain.py").write_text("from omlx import floor_mod\n")
    (package / "core" / "step.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import mlx.core as mx\n"
        "if TYPE_CHECKING:\n    from omlx.edge import typed\n"
        "def later():\n    from ..edge import lazy\n"
    )
    (package / "edge" / "lazy.py").write_text("def f():\n    import mlx_lm\n")
    (package / "edge" / "typed.py").write_text("from omlx.core.step import later\n")
    scan = ImportScan(package)
    assert scan.edges() == {
        ("core", "floor"): When.AT_IMPORT,
        ("core", "edge"): When.DEFERRED,
        ("edge", "core"): When.AT_IMPORT,
    }
    assert scan.mlx_modules() == {"omlx.core.step": When.AT_IMPORT, "omlx.edge.lazy": When.DEFERRED}
    assert scan.chain_to_mlx("omlx.edge.typed") == ["omlx.edge.typed", "omlx.core.step", "mlx.core"]
    assert scan.chain_to_mlx("omlx.edge.lazy") == scan.chain_to_mlx("omlx.core.plain") == []


@pytest.mark.spawns
def test_pure_layers_import_no_mlx(scan: ImportScan) -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {scan.expand(PURE)!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out
