"""Vectorised kernels for MLX's CPU backend on Linux, with MLX's exact arithmetic.

``mx.compile`` on the CPU backend fuses elementwise ops (mlx-lm's SwiGLU, GELU,
our compiled decode steps) into C++ kernels it builds at run time with
``g++ -O3`` and caches as shared libraries under ``$TMPDIR/mlx/<version>/cpu``.
The command has no ``-march`` and GCC inlines too little of MLX's ``simd::exp``:
every element goes through ``exp`` and six ``fmaf`` calls one at a time, and
SwiGLU becomes a large share of a prefill and of a batched decode step.

``enable`` points MLX at a ``g++`` of ours that adds ``JIT_FLAGS``:

- ``-march=native``: AVX2/FMA/AVX-512 code for this CPU (the kernels are built on
  this machine, for it);
- ``-ffp-contract=off``: no multiply and add fused where MLX's code writes them
  apart (GCC's default would fuse them and change the bits);
- ``-fno-trapping-math``: GCC may compute both sides of MLX's ``select`` and so
  vectorise the loop (no value changes; FP exceptions are never looked at);
- ``--param max-inline-insns-auto=2000``: ``simd::exp`` is inlined into the loop.

SwiGLU then runs many times faster, bit for bit the same (figures for this module:
benchmarks/README.md, "Figures behind design choices"). Before it
switches anything, a child process proves that the kernels it builds return the
bits of MLX's own (uncompiled) ops for the activations mlx-lm uses, over special
values and a dense grid; any difference and nothing is switched. The verdict is
kept per MLX version, compiler, flags and CPU, so the proof (seconds) runs once.

The kernels go to a cache directory of ours (``TMPDIR`` for the server process):
MLX names a kernel by its graph, not its flags, so a shared ``/tmp/mlx`` would
mix kernels built both ways (and hand ours to other MLX programs).
``OMLX_MLX_JIT=0`` switches this off. On macOS (Metal) nothing changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

from omlx.private_fs import make_private_dir

JIT_FLAGS = (
    "-march=native",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "--param",
    "max-inline-insns-auto=2000",
)
PROBE_TIMEOUT_S = 300.0


def default_root() -> Path:
    """Where the compiler wrapper, verdicts and kernels live (``OMLX_JIT_DIR``, else
    the user's cache directory: shared by every omlx server of this user)."""
    if os.environ.get("OMLX_JIT_DIR"):
        return Path(os.environ["OMLX_JIT_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "omlx" / "mlx-jit"


def _cpu_signature() -> str:
    """The CPU model and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [ln for ln in info if ln.startswith(("model name", "flags"))]
    except OSError:
        return "unknown"
    return "".join(sorted(set(lines)))


def _compiler_version(compiler: str) -> str:
    try:
        proc = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.splitlines()[0] if proc.returncode == 0 and proc.stdout else ""


def fingerprint(compiler: str, flags: tuple[str, ...]) -> str:
    """What decides the kernels' bits: MLX's version, the compiler, flags and CPU."""
    import mlx.core as mx

    parts = [mx.__version__, compiler, _compiler_version(compiler), *flags, _cpu_signature()]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest()


def write_wrapper(bin_dir: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    """A ``g++`` in ``bin_dir`` that runs ``compiler`` with ``flags`` first."""
    make_private_dir(bin_dir)
    script = bin_dir / "g++"
    text = f'#!/bin/sh\nexec {shlex.join([compiler, *flags])} "$@"\n'
    if not script.exists() or script.read_text() != text:
        tmp = bin_dir / f".g++.{os.getpid()}"
        tmp.write_text(text)
        tmp.chmod(0o700)  # run only by this user's omlx
        tmp.replace(script)
    return script


def _environ_with(bin_dir: Path, kernels: Path, base: MutableMapping[str, str]) -> dict[str, str]:
    env = dict(base)
    env["PATH"] = f"{bin_dir}{os.pathsep}{base.get('PATH', '')}"
    env["TMPDIR"] = str(kernels)
    return env


def probe(
    bin_dir: Path, kernels: Path, environ: MutableMapping[str, str]
) -> tuple[str | None, bool]:
    """Build the probe's kernels with the wrapper in a child process. Returns (None,
    True) when each returned MLX's own bits; (what differed, True) when some did not;
    (why, False) when the probe could not tell (worth trying again next start)."""
    make_private_dir(kernels)
    env = _environ_with(bin_dir, kernels, environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, "-m", "omlx.mlxjit", "probe"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the probe took over {PROBE_TIMEOUT_S:.0f} s", False
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the probe failed ({tail})", False
    result = json.loads(lines[-1])
    if not result["compiled"]:
        return "MLX built no kernels (is g++ working?)", False
    if result["differ"]:
        return "kernels differ from MLX's ops: " + ", ".join(result["differ"]), True
    return None, True


def _verdict(path: Path) -> tuple[bool, str | None]:
    """(known, why) from a kept verdict; unknown when missing or unreadable."""
    try:
        return True, json.loads(path.read_text())["why"]
    except (OSError, ValueError, KeyError, TypeError):
        return False, None


def enable(root: Path | None = None, environ: MutableMapping[str, str] | None = None) -> str:
    """Switch MLX's CPU kernels to the vectorising compiler for this process (call
    before anything is compiled); a one-line report, "on (...)" or "off (...)".
    ``environ`` (default ``os.environ``) gets ``PATH`` and ``TMPDIR`` when on."""
    environ = os.environ if environ is None else environ
    if environ.get("OMLX_MLX_JIT", "1") == "0":
        return "off (OMLX_MLX_JIT=0)"
    if not sys.platform.startswith("linux"):
        return "off (not Linux: MLX compiles for Metal)"
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return "off (MLX runs on the GPU)"
    compiler = shutil.which("g++", path=environ.get("PATH"))
    if compiler is None:
        return "off (no g++: apt-get install g++)"
    compiler = os.path.realpath(compiler)
    root = default_root() if root is None else root
    key = fingerprint(compiler, JIT_FLAGS)
    home = root / key
    bin_dir, kernels, verdict_file = home / "bin", home / "kernels", home / "verdict.json"
    try:
        write_wrapper(bin_dir, compiler, JIT_FLAGS)
        known, why = _verdict(verdict_file)
        if not known:
            why, definitive = probe(bin_dir, kernels, environ)
            if definitive:  # a failed probe is tried again next start
                tmp = home / f".verdict.{os.getpid()}"
                tmp.write_text(json.dumps({"why": why, "flags": JIT_FLAGS, "compiler": compiler}))
                tmp.replace(verdict_file)
        make_private_dir(kernels)
    except (OSError, ValueError, KeyError) as exc:
        return f"off ({home}: {exc})"
    if why is not None:
        return f"off ({why})"
    if environ is os.environ:
        # Python's own temporary files stay where they were (it keeps the first answer).
        tempfile.gettempdir()
    environ.update(_environ_with(bin_dir, kernels, environ))
    return f"on ({compiler} {' '.join(JIT_FLAGS)}; kernels in {kernels})"


# -- the probe (runs in a child process with the wrapper on PATH) -----------------


def _probe_inputs():
    import mlx.core as mx

    specials = [0.0, -0.0, 1e-40, -1e-40, 1e-30, 0.5, -0.5, 87.9, -87.9, 88.0, -88.0]
    specials += [88.5, -88.5, 3.4e38, -3.4e38, float("inf"), -float("inf"), float("nan")]
    x = mx.concatenate(
        [
            mx.array(specials),
            mx.linspace(-100.0, 100.0, 40001),
            mx.random.normal((20000,), key=mx.random.key(0)) * 4.0,
        ]
    )
    return x, x[::-1]


def _probe_functions():
    import mlx.core as mx
    import mlx.nn as nn

    return {
        "swiglu": lambda a, b: nn.silu(a) * b,
        "sigmoid": lambda a, b: mx.sigmoid(a) + b,
        "exp": lambda a, b: mx.exp(a) * b,
        "gelu": lambda a, b: nn.gelu(a) * b,
        "gelu_approx": lambda a, b: nn.gelu_approx(a) * b,
        "tanh": lambda a, b: mx.tanh(a) * b,
        "softplus": lambda a, b: mx.logaddexp(a, 0.0) * b,
        "rsqrt": lambda a, b: a * mx.rsqrt(mx.abs(b) + 1e-6),
        "log1p": lambda a, b: mx.log1p(mx.abs(a)) * b,
    }


def _run_probe() -> dict:
    """Each function compiled (one fused kernel per output, built by whatever g++ is
    on PATH) against the same function run op by op on MLX's own kernels."""
    import mlx.core as mx
    import numpy as np

    fns = _probe_functions()

    def every(a, b):
        return [f(a, b) for f in fns.values()]

    x, y = _probe_inputs()
    eager = every(x, y)
    compiled = mx.compile(every)(x, y)
    mx.eval(eager, compiled)
    differ = [
        name
        for name, e, c in zip(fns, eager, compiled, strict=True)
        if not np.array_equal(np.array(e).view(np.uint32), np.array(c).view(np.uint32))
    ]
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "mlx" / mx.__version__ / "cpu"
    built = len(list(root.glob("*.so"))) if root.is_dir() else 0
    return {"differ": differ, "compiled": built}


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        print(json.dumps(_run_probe()))
    else:
        print(enable())
