"""oQ end to end on real models: the job, its output in plain mlx-lm, the task
manager's child processes, the CLI, and oQ vs uniform quantization on SmolLM2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from omlx.errors import ModelLoadError, OutputExistsError
from omlx.quant.job import QuantOptions, quantize_folder
from omlx.quant.names import temp_dir_for
from omlx.quant.quality import perplexity, shipped_text, token_chunks
from omlx.quant.sensitivity import QuantCancelled
from omlx.quant.tasks import TaskManager
from tests.fixtures.servers import ROOT

# Small runs: the tiny models' tokenizer turns the shipped texts into many tokens.
FAST = QuantOptions(level="oQ4", max_calibration_tokens=256, max_eval_tokens=256)
FAST_WORKER_ARGS = ("--max-calibration-tokens", "256", "--max-eval-tokens", "256")


@pytest.fixture
def model_dir(tiny_models_dir: Path, tmp_path: Path) -> Path:
    """A private model dir (outputs land next to the sources) with copies of tiny models."""
    root = tmp_path / "models"
    for name in ("tiny-llama", "slow-llama"):
        shutil.copytree(tiny_models_dir / name, root / name)
    return root


def _wait_for(manager: TaskManager, task_id: str, phases: set[str], timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (task := manager.get(task_id))["phase"] not in phases:
        assert time.monotonic() < deadline, f"task stuck in {task['phase']}"
        time.sleep(0.05)
    return task


def test_quantized_model_loads_in_plain_mlx_lm_and_generates(model_dir: Path) -> None:
    from mlx_lm import generate, load

    dest = model_dir / "tiny-llama-oQ4"
    phases: list[str] = []
    result = quantize_folder(model_dir / "tiny-llama", dest, FAST, lambda p, _f: phases.append(p))
    assert list(dict.fromkeys(phases)) == [
        "loading",
        "measuring",
        "quantizing",
        "evaluating",
        "saving",
    ]
    assert result.bits_per_weight <= result.target_bits_per_weight == 5.0  # float32 scales
    assert sum(result.bits_histogram.values()) == result.num_layers == 16
    assert result.size_bytes == sum(p.stat().st_size for p in dest.glob("*.safetensors"))
    assert not temp_dir_for(dest).exists()

    model, tokenizer = load(str(dest))
    config = json.loads((dest / "config.json").read_text())
    quantized = {
        path: m
        for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    }
    assert len(quantized) == result.num_layers
    for path, module in quantized.items():
        assert module.bits == config["quantization"][path]["bits"]
    assert len(generate(model, tokenizer, "The harbour town", max_tokens=8)) > 0

    # The reported perplexity is the saved model's, run with real quantized matmuls.
    held = token_chunks(tokenizer.encode(shipped_text("heldout")), 512, 256)
    assert perplexity(model, held) == pytest.approx(result.perplexity_after, rel=1e-3)


def test_output_that_exists_is_refused_before_any_work(model_dir: Path) -> None:
    (model_dir / "taken").mkdir()
    with pytest.raises(OutputExistsError) as err:
        quantize_folder(model_dir / "tiny-llama", model_dir / "taken", FAST)
    assert err.value.http_status == 409


def test_cancel_mid_run_leaves_no_partial_folder(model_dir: Path) -> None:
    dest = model_dir / "cancelled"
    seen: list[str] = []
    with pytest.raises(QuantCancelled):
        quantize_folder(
            model_dir / "tiny-llama",
            dest,
            FAST,
            lambda phase, _f: seen.append(phase),
            should_stop=lambda: "evaluating" in seen,
        )
    assert "evaluating" in seen
    assert not dest.exists()
    assert not temp_dir_for(dest).exists()


def test_corrupt_weights_fail_with_the_reason(model_dir: Path) -> None:
    broken = model_dir / "broken"
    shutil.copytree(model_dir / "tiny-llama", broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ModelLoadError, match="cannot load 'broken'"):
        quantize_folder(broken, model_dir / "broken-oQ4", FAST)
    assert not (model_dir / "broken-oQ4").exists()


def test_task_manager_runs_a_child_and_the_model_appears(model_dir: Path) -> None:
    manager = TaskManager(model_dir, worker_args=FAST_WORKER_ARGS)
    try:
        task = manager.submit("tiny-llama", model_dir / "tiny-llama", "oQ3", 64, None)
        assert task["output_name"] == "tiny-llama-oQ3" and task["phase"] in ("queued", "loading")
        done = _wait_for(manager, task["id"], {"done", "failed", "cancelled"})
    finally:
        manager.shutdown()
    assert done["phase"] == "done", done["error"]
    assert done["percent"] == 100.0 and done["eta_s"] == 0.0 and done["elapsed_s"] > 0
    assert set(done["result"]) == {
        "size_bytes",
        "bits_per_weight",
        "perplexity_before",
        "perplexity_after",
        "num_layers",
        "bits_histogram",
    }
    assert (model_dir / "tiny-llama-oQ3" / "config.json").is_file()


def test_task_cancel_kills_the_child_and_removes_the_partial_folder(model_dir: Path) -> None:
    manager = TaskManager(model_dir)
    try:
        task = manager.submit("slow-llama", model_dir / "slow-llama", "oQ4", 64, "slow-q")
        running = _wait_for(manager, task["id"], {"measuring", "done", "failed"})
        assert running["phase"] == "measuring"
        cancelled = manager.cancel(task["id"])
    finally:
        manager.shutdown()
    assert cancelled["phase"] == "cancelled" and cancelled["error"] is None
    assert not (model_dir / "slow-q").exists()
    assert not temp_dir_for(model_dir / "slow-q").exists()
    assert sorted(p.name for p in model_dir.iterdir()) == ["slow-llama", "tiny-llama"]


def test_failed_task_reports_why(model_dir: Path) -> None:
    broken = model_dir / "broken"
    shutil.copytree(model_dir / "tiny-llama", broken)
    (broken / "model.safetensors").write_bytes(b"garbage" * 100)
    manager = TaskManager(model_dir, worker_args=FAST_WORKER_ARGS)
    try:
        task = manager.submit("broken", broken, "oQ4", 64, None)
        failed = _wait_for(manager, task["id"], {"done", "failed", "cancelled"})
    finally:
        manager.shutdown()
    assert failed["phase"] == "failed"
    assert "cannot load 'broken'" in failed["error"]
    assert failed["result"] is None and failed["eta_s"] is None
    assert not (model_dir / "broken-oQ4").exists()


def test_cli_quantize_end_to_end(model_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(model_dir / "tiny-llama", base / "models" / "tiny-llama")
    cmd = [sys.executable, "-m", "omlx.cli", "--base-path", str(base), "quantize", "tiny-llama"]
    run = subprocess.run(
        [*cmd, "--level", "oQ4", "--output", "tl4"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "measuring" in run.stderr and "100%" in run.stderr and "#" in run.stderr
    assert "tiny-llama -> " in run.stdout and "perplexity" in run.stdout
    assert (base / "models" / "tl4" / "model.safetensors").is_file()
    from mlx_lm import load

    load(str(base / "models" / "tl4"))
    again = subprocess.run([*cmd, "--output", "tl4"], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 1
    assert "already exists" in again.stderr
    bad = subprocess.run([*cmd, "--level", "oQ7"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1 and "oQ4" in bad.stderr


@pytest.mark.slow
def test_oq4_is_no_worse_than_uniform_4bit_on_smollm2(smollm2_path: Path, tmp_path: Path) -> None:
    """At equal stored bits per weight (uniform 4-bit = mlx-lm's own quantize_model),
    oQ4's held-out perplexity is no worse. Full numbers: benchmarks/README.md."""
    import copy

    from mlx_lm import load
    from mlx_lm.utils import dequantize_model, quantize_model

    options = QuantOptions(level="oQ4", max_calibration_tokens=512, max_eval_tokens=1024)
    result = quantize_folder(smollm2_path, tmp_path / "smol-oQ4", options)

    model, tokenizer, config = load(str(smollm2_path), return_config=True)
    held = token_chunks(tokenizer.encode(shipped_text("heldout")), 512, 1024)
    uniform = copy.deepcopy(model)
    quantize_model(uniform, config, 64, 4)
    uniform_bpw = 4 + 64 / 64  # float32 source: 32-bit scale and bias per group
    dequantize_model(uniform)
    uniform_ppl = perplexity(uniform, held)
    float_ppl = perplexity(model, held)
    mx.clear_cache()

    assert result.perplexity_before == pytest.approx(float_ppl, rel=1e-4)
    assert result.bits_per_weight <= uniform_bpw
    assert result.perplexity_after <= uniform_ppl, (result.perplexity_after, uniform_ppl)
