"""The batch's decode step runs each layer's work around attention compiled
(omlx/engine/compiled_batch.py, ``CompiledBatchStep``), on real (tiny, random) mlx-lm
models: the same logits and caches as mlx-lm's forward, the same tokens as
mlx-lm's own loop for every row, whatever the rows' lengths."""

from __future__ import annotations

import io
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from omlx.engine.batch import merge_caches
from omlx.engine.compiled import CompiledDecode
from omlx.engine.compiled_batch import CompiledBatchStep, CompiledSteps, batch_qualifies
from omlx.engine.runner import BatchRunner
from omlx.engine.strategy import ExecutionStrategy
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.tiny_models import build_tiny_model

PROMPTS = {
    "a": [(7 * i) % 200 + 3 for i in range(41)],
    "b": [(5 * i) % 150 + 2 for i in range(17)],
    "c": [(3 * i) % 120 + 9 for i in range(29)],
}


def reference(model, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def request(rid: str, prompt: list[int], n: int) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=n))


def make_runner(model, compiled: bool = True, steps: CompiledSteps | None = None) -> BatchRunner:
    return BatchRunner(
        model,
        prefill_step_size=64,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(compiled=compiled),
        compiled=steps,
    )


def collect(
    runner: BatchRunner,
    want: dict[str, int],
    got: dict[str, list[int]] | None = None,
    max_steps: int = 200,
) -> dict[str, list[int]]:
    """Step until each request in ``want`` has that many tokens (appended to
    ``got``, which keeps every request's tokens across calls)."""
    got = {} if got is None else got
    for rid in want:
        got.setdefault(rid, [])
    for _ in range(max_steps):
        for t in runner.step():
            got.setdefault(t.request_id, []).append(t.token_id)
        if all(len(got[rid]) >= n for rid, n in want.items()):
            return {rid: got[rid][: want[rid]] for rid in want}
    raise AssertionError(f"short: { {rid: len(v) for rid, v in got.items()} }")


MODELS = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    # Biases on q/k/v (qwen2's attention) and a head tied to the embeddings.
    "qwen2": ("llama", {"model_type": "qwen2", "tie_word_embeddings": True}),
    # Biases on every projection, attention and MLP.
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    # RoPE variants the step rotates with its per-step tables: interleaved pairs,
    # positions scaled (linear), and Llama 3's own frequencies.
    "llama-traditional-rope": ("llama", {"rope_traditional": True}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=7, **overrides)
    loaded, _ = load(str(path))
    assert batch_qualifies(loaded)
    return loaded


def batch_of(model, prompts: list[list[int]]) -> list[BatchKVCache]:
    rows = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=cache)
        rows.append(cache)
    return merge_caches(rows)


def test_logits_and_caches_equal_mlx_lms_forward(model) -> None:
    """Rows of different lengths (left padding, a mask) through 6 steps: the
    compiled step's logits and caches are mlx-lm's, bit for bit."""
    prompts = list(PROMPTS.values())
    step = CompiledBatchStep(model)
    compiled, eager = batch_of(model, prompts), batch_of(model, prompts)
    tokens = mx.array([11, 12, 13])
    for _ in range(6):
        got = step(tokens, compiled)
        assert got is not None
        want = model(tokens[:, None], cache=eager)[:, -1, :]
        assert mx.array_equal(got, want).item()
        tokens = mx.argmax(want, axis=-1)
    assert step.proven and step.steps == 6
    for c, e in zip(compiled, eager, strict=True):
        assert type(c) is BatchKVCache and c._idx == e._idx
        assert mx.array_equal(c.offset, e.offset).item()
        assert mx.array_equal(c.keys[..., : c._idx, :], e.keys[..., : e._idx, :]).item()
        assert mx.array_equal(c.values[..., : c._idx, :], e.values[..., : e._idx, :]).item()


def test_a_verification_forward_equals_mlx_lms_forward_of_the_same_tokens(model) -> None:
    """A speculative step feeds each row several tokens at once: the compiled
    step's logits at every position and its caches are mlx-lm's, bit for bit,
    at each width the batch uses, rows of different lengths."""
    prompts = list(PROMPTS.values())
    step = CompiledBatchStep(model)
    assert step.prove()
    compiled, eager = batch_of(model, prompts), batch_of(model, prompts)
    for width in (2, 5, 3):
        fed = mx.array([[(7 * r + j) % 100 + 1 for j in range(width)] for r in range(3)])
        got = step.verify(fed, compiled)
        assert got is not None
        assert mx.array_equal(got, model(fed, cache=eager)).item()
    for c, e in zip(compiled, eager, strict=True):
        assert c._idx == e._idx
        assert mx.array_equal(c.keys[..., : c._idx, :], e.keys[..., : e._idx, :]).item()


def pending_ops(array: mx.array) -> int:
    """Operations still to run for ``array`` (0 once it is evaluated)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, array)
    return dot.getvalue().count("shape=rectangle")


def test_no_cache_state_piles_up_unevaluated_between_steps(model) -> None:
    """Each step evaluates what the next one builds on: after 40 steps every
    layer's keys and values are evaluated and its offset is one addition away
    (a chain growing by a node per step and layer is memory that grows for as
    long as the batch runs; the load test's RSS bound caught one)."""
    step = CompiledBatchStep(model)
    cache = batch_of(model, list(PROMPTS.values()))
    tokens = mx.array([11, 12, 13])
    for _ in range(40):
        logits = step(tokens, cache)
        assert logits is not None
        tokens = mx.argmax(logits, axis=-1)
        mx.eval(tokens)
    for layer in cache:
        assert pending_ops(layer.keys) == pending_ops(layer.values) == 0
        assert pending_ops(layer.offset) <= 2  # offset + 1 (a broadcast and an add)


def test_a_batch_decodes_compiled_with_mlx_lms_tokens_for_every_row(model) -> None:
    """Three requests prefill and decode together, a fourth joins mid-decode
    (the batch grows to a size not traced yet): every row's tokens are mlx-lm's
    for that prompt alone."""
    runner = make_runner(model)
    runner.add([request(rid, p, 16) for rid, p in PROMPTS.items()])
    got: dict[str, list[int]] = {}
    collect(runner, {"a": 5}, got)
    late = [(11 * i) % 170 + 6 for i in range(23)]
    runner.add([request("d", late, 10)])
    collect(runner, {"a": 11, "b": 11, "c": 11, "d": 10}, got)
    step = runner.compiled_batch_step
    assert step is not None and step.proven and not step.failed
    assert step.steps >= 10
    for rid, prompt in PROMPTS.items():
        assert got[rid][:11] == reference(model, prompt, 16)[:11], rid
    assert got["d"][:10] == reference(model, late, 10)


def test_the_proof_never_delays_first_tokens(tiny_models_dir: Path) -> None:
    """The one-time check against the eager forward runs on a later step, not on
    the step that samples the batch's first tokens."""
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    runner = make_runner(model)
    runner.add([request(rid, p, 8) for rid, p in PROMPTS.items()])
    step = runner.compiled_batch_step
    assert step is not None
    firsts = runner.step()
    assert {t.request_id for t in firsts} == set(PROMPTS)
    assert not step.proven and step.steps == 0
    runner.step()
    assert step.proven and step.steps == 1


def test_models_outside_it_decode_their_batch_eagerly(tmp_path: Path) -> None:
    """Quantized projections, a RoPE that scales its input (YaRN), and another
    architecture: no compiled batch step, and the batch still gives mlx-lm's
    tokens."""
    llama, _ = load(str(build_tiny_model(tmp_path / "l", "llama", seed=2)))
    nn.quantize(llama, group_size=32, bits=8)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    yarn_llama, _ = load(str(build_tiny_model(tmp_path / "y", "llama", seed=3, rope_scaling=yarn)))
    gemma, _ = load(str(build_tiny_model(tmp_path / "g", "gemma3_text", seed=4)))
    for model in (llama, yarn_llama, gemma):
        assert not batch_qualifies(model)
        runner = make_runner(model)
        assert runner.compiled_batch_step is None
        runner.add([request(rid, p, 6) for rid, p in PROMPTS.items()])
        got = collect(runner, dict.fromkeys(PROMPTS, 6))
        for rid, prompt in PROMPTS.items():
            assert got[rid] == reference(model, prompt, 6), rid


def test_a_step_that_disagrees_with_the_eager_forward_leaves_the_batch_eager(
    tmp_path: Path,
) -> None:
    """Forced onto gemma3 (whose norms add one to their weights and whose
    embeddings are scaled: not the math the compiled step knows), the proof on
    its scratch batch disagrees with mlx-lm; the batch's own caches are never
    touched by it and every row decodes eagerly, as mlx-lm would."""
    path = build_tiny_model(tmp_path / "g", "gemma3_text", seed=4, sliding_window_pattern=1)
    model, _ = load(str(path))
    assert not batch_qualifies(model)
    step = CompiledBatchStep(model)
    # What the runner would hold had the model qualified.
    runner = make_runner(model, steps=CompiledSteps(CompiledDecode.for_model(model), step))
    runner.add([request(rid, p, 8) for rid, p in PROMPTS.items()])
    got = collect(runner, dict.fromkeys(PROMPTS, 8))
    assert step.failed and not step.proven and step.steps == 0
    for rid, prompt in PROMPTS.items():
        assert got[rid] == reference(model, prompt, 8), rid


def test_the_checks_can_run_before_any_request(tiny_models_dir: Path) -> None:
    """The pool proves both compiled steps at model load: afterwards every step of
    the first batch runs compiled, the one handing out the first tokens included
    (unproven, that one runs eagerly so it never waits on the check), with
    mlx-lm's tokens."""
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    runner = make_runner(model)
    runner.prove_compiled()
    step, solo = runner.compiled_batch_step, runner.compiled_decoder
    assert step is not None and step.proven and step.steps == 0
    assert solo is not None and solo.proven
    runner.add([request(rid, p, 6) for rid, p in PROMPTS.items()])
    got = collect(runner, dict.fromkeys(PROMPTS, 6))
    assert step.steps == 6
    for rid, prompt in PROMPTS.items():
        assert got[rid] == reference(model, prompt, 6), rid


def test_speculative_steps_verify_on_the_compiled_step(tiny_models_dir: Path) -> None:
    """With drafts on, every step of a batch runs compiled, the speculative ones
    (several tokens per row) included, and the tokens are still mlx-lm's."""
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    runner = make_runner(model)
    runner.prove_compiled()
    runner.num_draft = 4
    # Prompts that repeat themselves, so the n-gram drafter has guesses.
    prompts = {"a": list(range(3, 40)) * 3, "b": list(range(50, 71)) * 2}
    runner.add([request(rid, p, 24) for rid, p in prompts.items()])
    got = collect(runner, dict.fromkeys(prompts, 24))
    stats = runner.speculative_stats()
    assert stats["steps"] > 0 and stats["accepted"] > 0
    step = runner.compiled_batch_step
    assert step is not None and step.steps == runner.num_decode_steps
    for rid, prompt in prompts.items():
        assert got[rid] == reference(model, prompt, 24), rid


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_a_lone_request_continues_in_the_batch_after_its_first_token(
    tiny_models_dir: Path, name: str
) -> None:
    """A lone request prefills on its own (its prompt's last chunk samples the
    first token in the same forward), then decodes in the batch, whose compiled
    step is the faster one once proven: mlx-lm's tokens across a cache buffer
    growth, none from the lone sequence's own compiled step after the first."""
    model, _ = load(str(tiny_models_dir / name))
    runner = make_runner(model)
    runner.prove_compiled()
    step, solo = runner.compiled_batch_step, runner.compiled_decoder
    assert step is not None and solo is not None
    # 250 prompt tokens + 20 decoded: the batch's 256-token buffer grows mid-decode.
    prompt = [(7 * i) % 200 + 3 for i in range(250)]
    runner.add([request("a", prompt, 20)])
    steps_to_first = 0
    got: list[int] = []
    while not got:
        got += [t.token_id for t in runner.step()]
        steps_to_first += 1
    # The prompt went in in prefill chunks of 64, the last one sampling: no extra
    # decode step before the first token.
    assert steps_to_first == -(-(len(prompt) - 64) // 64) + 1
    got += collect(runner, {"a": 19})["a"]
    assert got == reference(model, prompt, 20)
    assert step.steps >= 17 and solo.steps == 0


def test_a_lone_request_stays_on_its_own_until_the_batch_step_is_proven(
    tiny_models_dir: Path,
) -> None:
    """Before the pool's proof (or when it failed) the batch step is not known to
    be right, so a lone request decodes on its own, compiled."""
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    runner = make_runner(model)
    step, solo = runner.compiled_batch_step, runner.compiled_decoder
    assert step is not None and solo is not None and not step.proven
    runner.add([request("a", PROMPTS["a"], 12)])
    got = collect(runner, {"a": 12})["a"]
    assert got == reference(model, PROMPTS["a"], 12)
    assert step.steps == 0 and solo.steps >= 9


def test_a_request_joins_a_lone_one_already_in_the_batch(tiny_models_dir: Path) -> None:
    """The lone request moved into the batch; a second one arriving later prefills
    and joins it: both get mlx-lm's tokens."""
    model, _ = load(str(tiny_models_dir / "tiny-qwen3"))
    runner = make_runner(model)
    runner.prove_compiled()
    runner.add([request("a", PROMPTS["a"], 16)])
    got = collect(runner, {"a": 6})
    runner.add([request("b", PROMPTS["b"], 8)])
    collect(runner, {"a": 16, "b": 8}, got)
    assert got["a"][:16] == reference(model, PROMPTS["a"], 16)
    assert got["b"][:8] == reference(model, PROMPTS["b"], 8)
