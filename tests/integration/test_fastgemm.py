"""The small-batch matmul behind MLX's BLAS on Linux (omlx/native/fastgemm.c):
faster at decode batch sizes, and bit-identical to OpenBLAS everywhere."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omlx import blas

RowMajor, NoTrans, Trans = 101, 111, 112
OPENBLAS = next((p for p in blas.OPENBLAS_CANDIDATES if p.exists()), None)
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or OPENBLAS is None,
    reason="the fast path is built on Linux, over Debian's OpenBLAS",
)


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


class Gemm:
    """cblas_sgemm of one library, on numpy arrays (row-major, C = A . op(B))."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        fn = self.lib.cblas_sgemm
        f, i, p = ctypes.c_float, ctypes.c_int, ctypes.c_void_p
        fn.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
        fn.restype = None

    def __call__(self, a, b, c, *, trans_b=True, alpha=1.0, beta=0.0, lda=None, ldb=None):
        m, k = c.shape[0], (b.shape[1] if trans_b else b.shape[0])
        n = c.shape[1]
        self.lib.cblas_sgemm(
            RowMajor, NoTrans, Trans if trans_b else NoTrans, m, n, k, alpha,
            a.ctypes.data, lda or a.strides[0] // 4, b.ctypes.data, ldb or b.strides[0] // 4,
            beta, c.ctypes.data, c.strides[0] // 4,
        )  # fmt: skip
        return c

    def counts(self) -> tuple[int, int]:
        fast, forwarded = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        self.lib.omlx_fastgemm_counts(ctypes.byref(fast), ctypes.byref(forwarded))
        return fast.value, forwarded.value

    def small_count(self) -> int:
        fn = self.lib.omlx_fastgemm_small_count
        fn.restype = ctypes.c_ulonglong
        return int(fn())

    def status(self) -> str:
        return blas.library_status(self.path)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fastgemm") / blas.FASTGEMM_NAME
    why = blas.build_fastgemm(OPENBLAS, out)
    assert why is None, why
    return out


@pytest.fixture(scope="module")
def fast(built) -> Gemm:
    return Gemm(built)


@pytest.fixture(scope="module")
def reference() -> Gemm:
    return Gemm(OPENBLAS)


def _rand(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def _kernel_on(lib: Gemm) -> bool:
    """Whether the kernel took over. On an AVX2/FMA CPU it does, unless this OpenBLAS
    sums in an order no block rule reproduces (then every call is forwarded: slower,
    still OpenBLAS's bits), which skips the tests that need the kernel."""
    status = lib.status()
    if status.startswith("off (no K-block rule"):
        pytest.skip(f"this OpenBLAS: {status}")
    return status.startswith("on")


def _cpu_has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def _small_on(lib: Gemm) -> bool:
    """Whether the small-matrix path took over. OpenBLAS has its small-matrix
    kernel in its AVX-512 builds (the ones it picks on an AVX-512 CPU), and there
    the library must reproduce it; on other CPUs OpenBLAS sums small problems
    another way, those calls are forwarded, and the tests that need the path skip."""
    if not _cpu_has_avx512():
        pytest.skip("no AVX-512: OpenBLAS runs no small-matrix kernel here")
    return _kernel_on(lib) and lib.status().endswith("; its small-matrix sums too)")


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="the kernel needs AVX2 and FMA")
def test_it_takes_over_after_proving_it_reproduces_openblas(fast):
    assert _kernel_on(fast), fast.status()
    assert fast.status().startswith("on (OpenBLAS K blocks of")


# (rows, K, N): a SmolLM2 layer's projections and head, and K values that split
# into OpenBLAS blocks differently (one block, halves, full blocks + halves).
SHAPES = [(r, 576, 1536) for r in (1, 2, 3, 8, 9, 16)] + [
    (1, 576, 49152),
    (8, 1536, 576),
    (8, 576, 4096),
    (5, 64, 4096),
    (7, 330, 608),
    (16, 700, 200),
    (4, 2048, 515),  # N not a multiple of 8
    (2, 1536, 576),  # M * N <= 1200 but M * N * K > 1e6: OpenBLAS's big kernel
    (3, 24, 100),  # M * N <= 1200 but K < 32: the same
]

# Inside OpenBLAS's small-matrix range (M * N <= 1200, M * N * K <= 1e6, K >= 32):
# one or two rows by a layer's projections, attention's scores (3 query heads by
# a few dozen keys), row and column counts off multiples of 4 (the kernel's two
# sum trees), K with and without a partial last block of 16.
SMALL_SHAPES = [
    (1, 576, 576),
    (1, 576, 192),
    (1, 1536, 576),
    (2, 576, 576),
    (2, 576, 192),
    (3, 64, 77),
    (3, 64, 130),
    (4, 32, 300),
    (5, 40, 203),
    (7, 100, 150),
    (16, 33, 75),
    (2, 47, 13),
    (1, 1536, 651),
]


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="the kernel needs AVX2 and FMA")
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_results_are_bit_identical_to_openblas(fast, reference, beta):
    assert _kernel_on(fast), fast.status()
    rng = np.random.default_rng(0)
    before = fast.counts()[0]
    for m, k, n in SHAPES:
        a, b, c = _rand(rng, m, k), _rand(rng, n, k), _rand(rng, m, n)
        want = reference(a, b, c.copy(), beta=beta)
        got = fast(a, b, c.copy(), beta=beta)
        assert want.tobytes() == got.tobytes(), (m, k, n, beta)
    assert fast.counts()[0] - before == len(SHAPES)  # every one ran the kernel


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="the kernel needs AVX2 and FMA")
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_small_problems_are_bit_identical_to_openblas_small_kernel(fast, reference, beta):
    """OpenBLAS sums these in its small-matrix kernel's order (16 lanes, then a
    tree); the library runs the same sums on every core instead of one."""
    assert _small_on(fast), fast.status()
    rng = np.random.default_rng(4)
    fast_before, small_before = fast.counts()[0], fast.small_count()
    for m, k, n in SMALL_SHAPES:
        a, b, c = _rand(rng, m, k), _rand(rng, n, k), _rand(rng, m, n)
        want = reference(a, b, c.copy(), beta=beta)
        got = fast(a, b, c.copy(), beta=beta)
        assert want.tobytes() == got.tobytes(), (m, k, n, beta)
    assert fast.small_count() - small_before == len(SMALL_SHAPES)
    assert fast.counts()[0] == fast_before


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="the kernel needs AVX2 and FMA")
def test_small_problems_with_strided_operands_are_bit_identical(fast, reference):
    """Attention's scores: the keys are rows of a longer cache buffer."""
    assert _small_on(fast), fast.status()
    rng = np.random.default_rng(5)
    q = _rand(rng, 3, 80)[:, :64]  # lda 80
    keys = _rand(rng, 256, 72)[:77, :64]  # ldb 72
    want_buf, got_buf = np.zeros((3, 90), np.float32), np.zeros((3, 90), np.float32)
    before = fast.small_count()
    want = reference(q, keys, want_buf[:, :77])  # ldc 90
    got = fast(q, keys, got_buf[:, :77])
    assert want.tobytes() == got.tobytes()
    assert not got_buf[:, 77:].any()
    assert fast.small_count() == before + 1


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="the kernel needs AVX2 and FMA")
def test_strided_operands_are_bit_identical(fast, reference):
    assert _kernel_on(fast), fast.status()
    before = fast.counts()[0]
    rng = np.random.default_rng(1)
    a = _rand(rng, 8, 600)[:, :576]  # rows of a wider buffer: lda 600
    b = _rand(rng, 1536, 640)[:, :576]
    want_buf, got_buf = np.zeros((8, 1600), np.float32), np.zeros((8, 1600), np.float32)
    want = reference(a, b, want_buf[:, :1536])  # ldc 1600
    got = fast(a, b, got_buf[:, :1536])
    assert want.tobytes() == got.tobytes()
    assert not got_buf[:, 1536:].any()  # nothing written past each row
    assert fast.counts()[0] == before + 1


def test_other_calls_go_to_openblas_unchanged(fast, reference):
    rng = np.random.default_rng(2)
    cases = [
        dict(m=17, k=576, n=1536, kw={}),  # more rows than the kernel takes
        dict(m=17, k=64, n=20, kw={}),  # the same, in the small-matrix range
        dict(m=2, k=8, n=64, kw={}),  # K too short for either kernel
        dict(m=8, k=576, n=1536, kw={"alpha": 0.5}),
        dict(m=8, k=576, n=1536, kw={"beta": 0.25}),
        dict(m=1, k=576, n=576, kw={"alpha": 0.5}),  # small range, other alpha
    ]
    fast_before, fwd_before = fast.counts()
    small_before = fast.small_count()
    for case in cases:
        m, k, n = case["m"], case["k"], case["n"]
        a, b, c = _rand(rng, m, k), _rand(rng, n, k), _rand(rng, m, n)
        want = reference(a, b, c.copy(), **case["kw"])
        got = fast(a, b, c.copy(), **case["kw"])
        assert want.tobytes() == got.tobytes(), case
    a, b = _rand(rng, 8, 576), _rand(rng, 576, 1536)  # B not transposed
    c = np.zeros((8, 1536), np.float32)
    assert np.array_equal(reference(a, b, c.copy(), trans_b=False), fast(a, b, c, trans_b=False))
    fast_after, fwd_after = fast.counts()
    assert fast_after == fast_before
    assert fast.small_count() == small_before
    assert fwd_after - fwd_before == len(cases) + 1


def test_without_a_compiler_the_build_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no cc
    out = tmp_path / blas.FASTGEMM_NAME
    assert blas.build_fastgemm(OPENBLAS, out) == "no C compiler (apt-get install gcc)"
    assert not out.exists()


def test_it_can_be_switched_off(built):
    code = "import sys; from pathlib import Path; from omlx import blas; "
    code += "print(blas.library_status(Path(sys.argv[1])))"
    env = {**os.environ, "OMLX_FASTGEMM": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(built)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "off (OMLX_FASTGEMM=0)"


@pytest.mark.skipif(not _cpu_has_avx2_fma(), reason="the kernel needs AVX2 and FMA")
def test_setup_put_it_under_mlx_and_decode_matmuls_use_it(reference):
    """What ./setup.sh links: MLX's matmul of a decode batch by a weight runs the
    kernel and returns OpenBLAS's bits."""
    import mlx.core as mx

    assert blas.fastgemm_status() is not None, blas.active_blas()
    mlx_side = Gemm(blas.mlx_fastgemm())
    assert _kernel_on(mlx_side), mlx_side.status()
    rng = np.random.default_rng(3)
    x, w = _rand(rng, 8, 576), _rand(rng, 1536, 576)
    before = mlx_side.counts()[0]
    got = np.array(mx.array(x) @ mx.array(w).T)
    assert mlx_side.counts()[0] > before
    want = reference(x, w, np.zeros((8, 1536), np.float32))
    assert want.tobytes() == got.tobytes()
    # A lone sequence's projection: OpenBLAS's small-matrix sums, on every core
    # (on AVX-512 CPUs, where OpenBLAS has that kernel; forwarded elsewhere).
    x1, w1 = _rand(rng, 1, 576), _rand(rng, 576, 576)
    before = mlx_side.small_count()
    got = np.array(mx.array(x1) @ mx.array(w1).T)
    if _cpu_has_avx512():
        assert mlx_side.small_count() > before, mlx_side.status()
    want = reference(x1, w1, np.zeros((1, 576), np.float32))
    assert want.tobytes() == got.tobytes()
