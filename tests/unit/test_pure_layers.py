"""The pure layers import no MLX (docs/ARCHITECTURE.md): the scheduler, the prefix
index that decides cache hits, the step's memory rules and the execution strategy
run and test without it, and admission never waits on an MLX import."""

from __future__ import annotations

import subprocess
import sys

PURE = (
    "omlx.scheduler",
    "omlx.cache.prefix_index",
    "omlx.cache.blocks",
    "omlx.memory.budget",
    "omlx.memory.throttle",
    "omlx.memory.guard",
    "omlx.engine.strategy",
    "omlx.engine.ngram",
    "omlx.mlx_types",
)


def test_pure_layers_import_no_mlx() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {PURE!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out
