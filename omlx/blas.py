"""Which BLAS MLX's CPU backend uses, and pointing it at a fast one on Linux.

The ``mlx[cpu]`` wheel bundles a reference BLAS that is far slower than
OpenBLAS for float32 matmul (figures: benchmarks/README.md, "Figures behind
design choices"). ``link`` builds ``native/fastgemm.c`` (OpenBLAS
behind a small-batch matmul kernel with OpenBLAS's exact arithmetic) and points
the venv's bundled library at it (without a C compiler: at OpenBLAS itself;
``OMLX_FASTGEMM=0`` switches the fast path off at run time). The original is kept beside it as
``.orig``. On macOS MLX uses Metal and Accelerate, and nothing is linked.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"),
    Path("/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3"),
)
FASTGEMM_SOURCE = Path(__file__).with_name("native") / "fastgemm.c"
FASTGEMM_NAME = "libomlx-fastgemm.so"


def _bundled_libs_dir() -> Path | None:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "mlx_cpu.libs"
    return libs if libs.is_dir() else None


def bundled_blas_files() -> list[Path]:
    """The reference BLAS shipped inside the mlx[cpu] wheel (Linux only)."""
    libs = _bundled_libs_dir()
    if libs is None:
        return []
    return sorted(
        p
        for p in libs.iterdir()
        if p.name.startswith("libblas") and "." in p.name and not p.name.endswith(".orig")
    )


def build_fastgemm(openblas: Path, out: Path) -> str | None:
    """Compile the fast-path library for this machine's CPU into ``out``; None when
    it was built (or is up to date), else why not."""
    if out.exists() and out.stat().st_mtime >= FASTGEMM_SOURCE.stat().st_mtime:
        return None
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return "no C compiler (apt-get install gcc)"
    tmp = out.with_name(out.name + ".tmp")
    cmd = [
        compiler,
        *("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Wall"),
        f'-DOPENBLAS_PATH="{openblas}"',
        str(FASTGEMM_SOURCE),
        *("-o", str(tmp), "-ldl"),
        # OpenBLAS answers every other BLAS and LAPACK call MLX makes.
        *("-Wl,--no-as-needed", f"-Wl,-rpath,{openblas.parent}", str(openblas)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return "build failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    tmp.replace(out)
    return None


def link() -> str:
    """Point the bundled BLAS at the fast path (or OpenBLAS); a one-line report."""
    if not sys.platform.startswith("linux"):
        return "not Linux: MLX uses Metal/Accelerate, nothing to link"
    openblas = next((p for p in OPENBLAS_CANDIDATES if p.exists()), None)
    if openblas is None:
        return "OpenBLAS not found (apt-get install libopenblas0-pthread); MLX stays slow"
    files = bundled_blas_files()
    if not files:
        return "no bundled BLAS found in mlx[cpu]; nothing to link"
    fast = files[0].with_name(FASTGEMM_NAME)
    why = build_fastgemm(openblas, fast)
    target, note = (fast, "") if why is None else (openblas, f" (fast path: {why})")
    for lib in files:
        if lib.is_symlink() and lib.resolve() == target.resolve():
            continue
        backup = lib.with_name(lib.name + ".orig")
        if not lib.is_symlink() and not backup.exists():
            lib.rename(backup)
        else:
            lib.unlink()
        lib.symlink_to(target)
    return f"mlx[cpu] BLAS -> {target}{note}"


def _loaded(fragment: str) -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if fragment in line.lower()})
    except OSError:
        return []


def mlx_fastgemm() -> Path | None:
    """The fast-path library MLX loaded in this process (import mlx first), if any."""
    files = bundled_blas_files()
    if not files:
        return None
    target = files[0].resolve()
    return target if target.name == FASTGEMM_NAME and str(target) in _loaded("fastgemm") else None


def library_status(path: Path) -> str:
    """A fast-path library's own report: "on (...)" or "off (...)" with the reason
    (it decides on first use). Loading a path this process already loaded reuses
    that instance."""
    lib = ctypes.CDLL(str(path))
    lib.omlx_fastgemm_status.restype = ctypes.c_char_p
    return lib.omlx_fastgemm_status().decode()


def fastgemm_status() -> str | None:
    """The report of the fast-path library MLX loaded, or None when it did not."""
    path = mlx_fastgemm()
    return None if path is None else library_status(path)


def active_blas() -> str:
    """Name the BLAS library loaded into this process (import mlx first)."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    paths = _loaded("blas")
    openblas = [p for p in paths if "openblas" in p]
    if openblas:
        fast = fastgemm_status()
        extra = f"; small-batch matmul {fast}" if fast else ""
        return f"OpenBLAS ({openblas[0]}){extra}"
    if paths:
        return "reference BLAS, slow (" + paths[0] + "); run ./setup.sh to link OpenBLAS"
    return "none loaded yet"


if __name__ == "__main__":
    if sys.argv[1:2] == ["link"]:
        print("[setup] " + link(), file=sys.stderr)
    else:
        import mlx.core  # noqa: F401  (load the library so its BLAS shows up)

        print(active_blas())
