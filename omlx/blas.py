"""Which BLAS MLX's CPU backend uses, and pointing it at OpenBLAS on Linux.

The ``mlx[cpu]`` wheel bundles a reference BLAS that is about 30x slower than
OpenBLAS for float32 matmul. ``link`` replaces the venv's bundled library with
a symlink to Debian's OpenBLAS (the original is kept beside it as ``.orig``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"),
    Path("/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3"),
)


def bundled_blas_files() -> list[Path]:
    """The reference BLAS shipped inside the mlx[cpu] wheel (Linux only)."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return []
    site = Path(next(iter(spec.submodule_search_locations))).parent
    libs = site / "mlx_cpu.libs"
    if not libs.is_dir():
        return []
    return sorted(
        p
        for p in libs.iterdir()
        if p.name.startswith("libblas") and "." in p.name and not p.name.endswith(".orig")
    )


def link_openblas() -> str:
    """Point the bundled BLAS at OpenBLAS; returns a one-line report."""
    if not sys.platform.startswith("linux"):
        return "not Linux: MLX uses Metal/Accelerate, nothing to link"
    target = next((p for p in OPENBLAS_CANDIDATES if p.exists()), None)
    if target is None:
        return "OpenBLAS not found (apt-get install libopenblas0-pthread); MLX stays slow"
    files = bundled_blas_files()
    if not files:
        return "no bundled BLAS found in mlx[cpu]; nothing to link"
    for lib in files:
        if lib.is_symlink() and lib.resolve() == target.resolve():
            continue
        backup = lib.with_name(lib.name + ".orig")
        if not lib.is_symlink() and not backup.exists():
            lib.rename(backup)
        else:
            lib.unlink()
        lib.symlink_to(target)
    return f"mlx[cpu] BLAS -> {target}"


def active_blas() -> str:
    """Name the BLAS library loaded into this process (import mlx first)."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "blas" in line.lower()}
    except OSError:
        return "unknown"
    if any("openblas" in p for p in paths):
        return "OpenBLAS (" + sorted(p for p in paths if "openblas" in p)[0] + ")"
    if paths:
        return "reference BLAS, slow (" + sorted(paths)[0] + "); run ./setup.sh to link OpenBLAS"
    return "none loaded yet"


if __name__ == "__main__":
    if sys.argv[1:] == ["link"]:
        print("[setup] " + link_openblas(), file=sys.stderr)
    else:
        import mlx.core  # noqa: F401  (load the library so its BLAS shows up)

        print(active_blas())
