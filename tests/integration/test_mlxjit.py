"""MLX's run-time CPU kernels built vectorised (omlx/mlxjit.py): on only when they
keep MLX's bits, and then a real mlx-lm model returns exactly the logits it
returns with MLX's default kernels.

Every kernel build and model run happens in a child process: the switch changes
the process's PATH and TMPDIR, and MLX keeps each kernel it loaded for good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from omlx import mlxjit

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="MLX compiles CPU kernels with g++ on Linux only"
)

# mlx-lm's llama through its compiled SwiGLU: logits of a prompt and a few greedy tokens.
MODEL_RUN = textwrap.dedent(
    """
    import sys, numpy as np, mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, _ = load(sys.argv[1])
    prompt = mx.array([(7 * i) % 200 + 3 for i in range(40)])
    logits = model(prompt[None])
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=6)]
    np.save(sys.argv[2], np.array(logits.astype(mx.float32)))
    print(tokens)
    """
)


def _run_model(model: Path, out: Path, env: dict[str, str]) -> list[int]:
    proc = subprocess.run(
        [sys.executable, "-c", MODEL_RUN, str(model), str(out)],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _server_env() -> dict[str, str]:
    """This process's environment as ``omlx serve`` would start with it."""
    return {k: v for k, v in os.environ.items() if k not in ("OMLX_MLX_JIT", "TMPDIR")}


def _enable_with_flag(
    flag: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, str], dict[str, str]]:
    """``enable`` with ``flag`` added to the wrapper's: (status, env after, env before)."""
    monkeypatch.setattr(mlxjit, "JIT_FLAGS", (*mlxjit.JIT_FLAGS, flag))
    env = _server_env()
    before = dict(env)
    return mlxjit.enable(root, environ=env), env, before


def _kernels(tmpdir: str) -> list[Path]:
    return sorted(Path(tmpdir).glob("mlx/*/cpu/*.so"))


@pytest.fixture(scope="module")
def switched_on(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str], Path]:
    """``enable`` on a fresh cache root (runs the proof once for the module)."""
    root = tmp_path_factory.mktemp("mlx-jit")
    env = _server_env()
    status = mlxjit.enable(root, environ=env)
    return status, env, root


def test_kernels_built_vectorised_keep_a_models_logits_bit_for_bit(
    switched_on, tiny_models_dir: Path, tmp_path: Path
) -> None:
    status, env, root = switched_on
    assert status.startswith("on ("), status
    wrapper = Path(env["PATH"].split(os.pathsep)[0]) / "g++"
    assert wrapper.is_file() and "-ffp-contract=off" in wrapper.read_text()
    assert Path(env["TMPDIR"]).is_relative_to(root)

    default_tmp = tmp_path / "default-kernels"
    default_tmp.mkdir()
    default_env = {k: v for k, v in os.environ.items() if k != "TMPDIR"} | {
        "TMPDIR": str(default_tmp)
    }
    model = tiny_models_dir / "tiny-llama"
    ours = _run_model(model, tmp_path / "ours.npy", env)
    theirs = _run_model(model, tmp_path / "default.npy", default_env)
    a, b = np.load(tmp_path / "ours.npy"), np.load(tmp_path / "default.npy")
    assert a.view(np.uint32).tobytes() == b.view(np.uint32).tobytes()
    assert ours == theirs and len(ours) == 6

    # Each side built its kernels in its own directory; ours are vectorised: no
    # kernel of ours calls MLX's one-element exp or libm's fmaf, while MLX's
    # default build of the same SwiGLU kernel does.
    mine = [k for k in _kernels(env["TMPDIR"]) if "Sigmoid" in k.name]
    default = [k for k in _kernels(str(default_tmp)) if "Sigmoid" in k.name]
    assert mine and default
    assert all(b"fmaf" not in k.read_bytes() for k in mine)
    assert any(b"fmaf" in k.read_bytes() for k in default)


def test_the_verdict_is_kept_and_the_switch_is_the_same_next_start(switched_on) -> None:
    status, env, root = switched_on
    verdicts = list(root.glob("*/verdict.json"))
    assert len(verdicts) == 1 and json.loads(verdicts[0].read_text())["why"] is None
    again = _server_env()
    assert mlxjit.enable(root, environ=again) == status
    assert again["TMPDIR"] == env["TMPDIR"] and again["PATH"] == env["PATH"]


def test_flags_that_change_the_bits_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # -ffast-math lets GCC reorder and approximate: the proof sees other bits.
    status, env, before = _enable_with_flag("-ffast-math", tmp_path, monkeypatch)
    assert status.startswith("off (kernels differ from MLX's ops: "), status
    assert "swiglu" in status
    assert env == before  # nothing switched
    # Remembered: the next start says the same without building anything again.
    (verdict,) = tmp_path.glob("*/verdict.json")
    stamp = verdict.stat().st_mtime_ns
    assert mlxjit.enable(tmp_path, environ=env) == status and verdict.stat().st_mtime_ns == stamp


def test_off_when_asked_or_without_a_compiler(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "OMLX_MLX_JIT": "0"}
    assert mlxjit.enable(tmp_path, environ=env) == "off (OMLX_MLX_JIT=0)"
    env = {"PATH": str(tmp_path / "empty")}
    assert mlxjit.enable(tmp_path, environ=env) == "off (no g++: apt-get install g++)"
    assert env == {"PATH": str(tmp_path / "empty")} and not list(tmp_path.iterdir())


def test_a_probe_that_cannot_tell_is_tried_again_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A flag g++ rejects: MLX cannot build the probe's kernels. Nothing is switched
    # and no verdict is kept (a broken compiler may be fixed before the next start).
    status, env, before = _enable_with_flag("-fno-such-flag-omlx", tmp_path, monkeypatch)
    assert status.startswith("off (the probe failed"), status
    assert env == before and not list(tmp_path.glob("*/verdict.json"))
