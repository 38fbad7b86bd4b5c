"""Execution strategies (issue 28): chosen once per model load from the backend,
and none changes a token. The plain strategy (what a GPU runs) and the CPU's
fast paths give mlx-lm's own greedy tokens for a lone request, a burst and a
request arriving mid-decode, on real tiny llama and qwen3 models."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from omlx.engine.runner import BatchRunner
from omlx.engine.strategy import ExecutionStrategy
from omlx.settings import Settings
from tests.integration.test_runner_steps import reference, request, run, tokens_of

PLAIN_GPU_SHAPE = ExecutionStrategy("plain", solo_prefill=False, compiled=False, pipelined=True)
STRATEGIES = {
    "fast_paths": ExecutionStrategy.choose("fast_paths", "cpu"),
    "plain": ExecutionStrategy.choose("plain", "cpu"),
    "plain-pipelined": PLAIN_GPU_SHAPE,
}


def test_auto_picks_the_measured_fast_paths_on_the_cpu_and_the_plain_path_on_metal() -> None:
    cpu, gpu = ExecutionStrategy.choose("auto", "cpu"), ExecutionStrategy.choose("auto", "gpu")
    assert (cpu.name, cpu.solo_prefill, cpu.compiled, cpu.pipelined) == (
        "fast_paths",
        True,
        True,
        False,
    )
    # The GPU's shape, on the GPU (whose budgets the batch follows).
    assert gpu == dataclasses.replace(PLAIN_GPU_SHAPE, device="gpu")
    assert cpu.device == "cpu"
    # Forcing one to measure it keeps the device's pipelining.
    assert ExecutionStrategy.choose("fast_paths", "gpu").pipelined


def test_the_setting_refuses_an_unknown_strategy_naming_the_choices() -> None:
    with pytest.raises(ValueError) as err:
        Settings.model_validate({"scheduler": {"execution_strategy": "turbo"}})
    assert "execution_strategy" in str(err.value) and "plain" in str(err.value)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def model(request: pytest.FixtureRequest, tiny_models_dir: Path):
    loaded, _ = load(str(tiny_models_dir / request.param))
    return loaded


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_gives_mlx_lm_greedy_tokens(model, name: str) -> None:
    strategy = STRATEGIES[name]
    runner = BatchRunner(
        model, prefill_step_size=16, stream=mx.new_stream(mx.cpu), strategy=strategy
    )
    runner.prove_compiled()
    prompts = {"lone": list(range(200, 237)), "a": list(range(3, 25)), "b": list(range(60, 99))}
    prompts["late"] = list(range(300, 321))
    runner.add([request("lone", prompts["lone"], 10)])
    steps = run(runner, 4)
    runner.add([request(rid, prompts[rid], 10) for rid in ("a", "b")])
    steps += run(runner, 3)
    runner.add([request("late", prompts["late"], 10)])
    steps += run(runner, 16)
    got = tokens_of(steps)
    for rid, prompt in prompts.items():
        assert got[rid][:10] == reference(model, prompt, 10), (name, rid)
    if not strategy.compiled:  # the plain path runs eager
        assert runner.compiled_batch_step is None and runner.compiled_decoder is None
    runner.close()
