"""Logprobs from the runner's every decode path, checked against one full forward
of the same tokens (a tiny random llama: its distributions are far from one-hot)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from omlx.api.prompts import choice_requests
from omlx.engine.logprobs import log_softmax
from omlx.engine.runner import BatchRunner
from omlx.engine.scoring import score_prompt
from omlx.engine.strategy import ExecutionStrategy
from omlx.scheduler import Request, SamplingParams, TokenLogprob
from omlx.scheduler.openings import plan_openings
from tests.fixtures.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def llama(tiny_models_dir: Path):
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    return model


def _request(rid: str, prompt: list[int], logprobs: int | None, n: int = 6) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=n, logprobs=logprobs)
    return Request(rid, tuple(prompt), params)


def _run(
    model, requests: list[Request], *, pipelined: bool, compiled: bool, steps: int = 12
) -> dict[str, list[tuple[int, TokenLogprob | None]]]:
    runner = BatchRunner(
        model,
        prefill_step_size=64,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(pipelined=pipelined, compiled=compiled),
    )
    runner.prove_compiled()
    runner.add(requests)
    got: dict[str, list[tuple[int, TokenLogprob | None]]] = {}
    for _ in range(steps):
        for t in runner.step():
            got.setdefault(t.request_id, []).append((t.token_id, t.logprobs))
    return got


def _reference(model, prompt: list[int], tokens: list[int]) -> list[mx.array]:
    """Each generated position's log-softmax, from one forward of prompt + tokens."""
    seq = mx.array(prompt + tokens)[None]
    lp = log_softmax(model(seq)[0])
    return [lp[len(prompt) - 1 + i] for i in range(len(tokens))]


@pytest.mark.parametrize(("pipelined", "compiled"), [(False, True), (False, False), (True, False)])
def test_logprobs_match_a_full_forward_in_solo_and_batch(
    llama, pipelined: bool, compiled: bool
) -> None:
    prompts = {"solo": list(range(3, 20))}
    got = _run(
        llama, [_request("solo", prompts["solo"], 3)], pipelined=pipelined, compiled=compiled
    )
    batch = {"a": list(range(5, 30)), "b": list(range(40, 52)), "c": list(range(60, 75))}
    asks = {"a": 3, "b": None, "c": 0}
    reqs = [_request(rid, p, asks[rid]) for rid, p in batch.items()]
    got |= _run(llama, reqs, pipelined=pipelined, compiled=compiled)
    prompts |= batch
    asks["solo"] = 3
    for rid, out in got.items():
        tokens = [t for t, _ in out]
        assert len(tokens) >= 6
        if asks[rid] is None:
            assert all(lp is None for _, lp in out)
            continue
        for (token, lp), ref in zip(out, _reference(llama, prompts[rid], tokens), strict=True):
            assert lp is not None and lp.token_id == token
            assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-3)
            assert len(lp.top) == asks[rid]
            if lp.top:  # greedy: the chosen token is the best one
                assert lp.top[0] == (token, lp.logprob)
                values = [v for _, v in lp.top]
                assert values == sorted(values, reverse=True)


def test_scoring_gives_each_prompt_token_its_logprob_in_small_chunks(llama) -> None:
    prompt = list(range(3, 40))
    with mx.stream(mx.new_stream(mx.cpu)):
        scored = score_prompt(llama, prompt, top_k=2, chunk_tokens=5)
        full = log_softmax(llama(mx.array(prompt)[None])[0])
    assert len(scored) == len(prompt) - 1
    for i, lp in enumerate(scored):
        token = prompt[i + 1]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(full[i, token].item(), abs=1e-3)
        assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]


class _CountingModel:
    """The model, counting the token-rows its forwards are fed."""

    def __init__(self, model) -> None:
        self._model = model
        self.rows = 0

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        self.rows += inputs.shape[0] * inputs.shape[1]
        return self._model(inputs, cache=cache)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def test_n_choices_prefill_their_prompt_once(llama) -> None:
    prompt = list(range(3, 43))
    counting = _CountingModel(llama)
    runner = BatchRunner(
        counting,
        prefill_step_size=64,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(compiled=False),
    )
    params = SamplingParams(temperature=0.0, max_tokens=4)
    choices = choice_requests("c", prompt, params, None, 3)
    runner.add(choices, plan_openings(choices, {c.request_id: 0 for c in choices}, 64))
    first = runner.step()
    # The opening (all but each choice's last two tokens) once, then two tokens a row.
    assert counting.rows == (len(prompt) - 2) + 3 * 2
    got: dict[str, list[int]] = {}
    for t in first + runner.step() + runner.step():
        got.setdefault(t.request_id, []).append(t.token_id)
    alone = _run(llama, [_request("x", prompt, None, 3)], pipelined=False, compiled=False)
    assert list(got.values()) == [[t for t, _ in alone["x"][:3]]] * 3


@pytest.mark.parametrize(("arch", "seed"), [("qwen3", 1), ("lfm2", 3), ("gemma3_text", 4)])
def test_logprobs_on_other_architectures(tmp_path: Path, arch: str, seed: int) -> None:
    model, _ = load(str(build_tiny_model(tmp_path / arch, arch, seed=seed)))
    prompts = {"a": list(range(5, 30)), "b": list(range(40, 52)), "solo": list(range(7, 21))}
    got = _run(model, [_request("solo", prompts["solo"], 2)], pipelined=False, compiled=True)
    reqs = [_request("a", prompts["a"], 2), _request("b", prompts["b"], None)]
    got |= _run(model, reqs, pipelined=False, compiled=True)
    assert all(lp is None for _, lp in got["b"])
    for rid in ("a", "solo"):
        tokens = [t for t, _ in got[rid]]
        for (token, lp), ref in zip(got[rid], _reference(model, prompts[rid], tokens), strict=True):
            assert lp is not None and lp.logprob == pytest.approx(ref[token].item(), abs=1e-3)
            assert lp.top[0] == (token, lp.logprob)


def test_logprobs_from_the_compiled_solo_decode(tiny_models_dir: Path) -> None:
    # Quantized projections: no compiled batch step, so a lone request decodes on
    # its own, through the compiled single-sequence step.
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    nn.quantize(model, group_size=32, bits=8)
    runner = BatchRunner(model, prefill_step_size=64, stream=mx.new_stream(mx.cpu))
    runner.prove_compiled()
    assert runner.compiled_batch_step is None and runner.compiled_decoder is not None
    prompt = list(range(3, 20))
    runner.add([_request("solo", prompt, 2)])
    out = [(t.token_id, t.logprobs) for _ in range(8) for t in runner.step()]
    assert runner.compiled_decoder.steps > 0
    tokens = [t for t, _ in out]
    for (token, lp), ref in zip(out, _reference(model, prompt, tokens), strict=True):
        assert lp is not None and lp.logprob == pytest.approx(ref[token].item(), abs=1e-3)
        assert lp.top[0] == (token, lp.logprob)


def _tokens_by_request(runner: BatchRunner, steps: int) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(steps):
        for t in runner.step():
            got.setdefault(t.request_id, []).append(t.token_id)
    return got


def test_n_choices_of_a_long_prompt_prefill_it_once(llama) -> None:
    prompt = [(7 * i) % 300 + 3 for i in range(40)]  # more than two 16-token chunks
    counting = _CountingModel(llama)
    runner = BatchRunner(
        counting,
        prefill_step_size=16,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(compiled=False),
    )
    params = SamplingParams(temperature=0.0, max_tokens=4)
    runner.add(choice_requests("c", prompt, params, None, 3))
    got = _tokens_by_request(runner, 3)
    while len(got) < 3 or min(map(len, got.values())) < 3:
        for rid, tokens in _tokens_by_request(runner, 1).items():
            got.setdefault(rid, []).extend(tokens)
    # One row prefills all but the last prompt token; the decode steps feed 3 rows.
    prefill_rows = len(prompt) - 1
    assert counting.rows <= prefill_rows + 3 * max(map(len, got.values()))
    alone = _run(llama, [_request("x", prompt, None, 3)], pipelined=False, compiled=False)
    assert [tokens[:3] for tokens in got.values()] == [[t for t, _ in alone["x"][:3]]] * 3


def test_choices_whose_leader_leaves_prefill_on_their_own(llama) -> None:
    prompt = [(11 * i) % 300 + 3 for i in range(40)]
    runner = BatchRunner(
        llama,
        prefill_step_size=16,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(compiled=False),
    )
    params = SamplingParams(temperature=0.0, max_tokens=4)
    choices = choice_requests("c", prompt, params, None, 3)
    runner.add(choices)
    runner.step()  # the leader's first chunk
    runner.remove([choices[0].request_id])
    got = _tokens_by_request(runner, 6)
    alone = _run(llama, [_request("x", prompt, None, 3)], pipelined=False, compiled=False)
    assert set(got) == {choices[1].request_id, choices[2].request_id}
    assert [tokens[:3] for tokens in got.values()] == [[t for t, _ in alone["x"][:3]]] * 2
