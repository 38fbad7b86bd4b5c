"""Draft-model speculative decoding in the runner: greedy tokens identical to
plain decoding (lone rows, batches whose rows keep different numbers of drafts,
pipelined, rows that opt out), and sampled tokens that follow the model's own
distribution however the draft model guesses."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from omlx.engine import batch
from omlx.engine.runner import BatchRunner
from omlx.engine.strategy import ExecutionStrategy
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.speculation import run_to_max_tokens
from tests.fixtures.tiny_models import build_tiny_model

PROMPTS = [list(range(3, 40)), list(range(50, 71)) * 2, list(range(90, 100)) * 4]


@pytest.fixture(scope="module")
def target(tiny_models_dir: Path):
    return load(str(tiny_models_dir / "tiny-llama"))[0]


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory):
    """One layer, other weights, the same vocabulary: it often guesses wrong."""
    folder = tmp_path_factory.mktemp("draft") / "small"
    return load(str(build_tiny_model(folder, "llama", seed=9, num_hidden_layers=1)))[0]


@pytest.fixture(scope="module")
def twin_draft(tiny_models_dir: Path):
    """The target's own weights: it guesses what the target picks."""
    return load(str(tiny_models_dir / "tiny-llama"))[0]


def run(
    model,
    requests: list[Request],
    draft=None,
    num_draft: int = 4,
    pipelined: bool = False,
    prefill_step_size: int = 64,
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Every token each request got until its max_tokens, and the speculative counters."""
    runner = BatchRunner(
        model,
        prefill_step_size=prefill_step_size,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(pipelined=pipelined),
    )
    runner.prove_compiled()
    if draft is not None:
        runner.set_draft(draft, model.args.vocab_size)
        runner.num_draft = num_draft
    return run_to_max_tokens(runner, requests)


def greedy(rid: str, prompt: list[int], n: int = 30, **kw) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=n, **kw))


@pytest.mark.parametrize("pipelined", [False, True])
def test_greedy_tokens_are_the_plain_tokens(target, small_draft, twin_draft, pipelined) -> None:
    batched = [greedy(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    for requests in ([greedy("a", PROMPTS[0])], batched):
        plain, _ = run(target, requests, pipelined=pipelined)
        wrong, stats = run(target, requests, small_draft, num_draft=3, pipelined=pipelined)
        assert wrong == plain
        assert stats["drafted"] > 0 and stats["accepted"] < stats["drafted"]
        right, stats = run(target, requests, twin_draft, pipelined=pipelined)
        assert right == plain
        assert stats["accepted"] > 0.9 * stats["drafted"] > 0


def test_the_draft_runs_compiled_and_drafts_what_it_drafts_eagerly(target, small_draft) -> None:
    """With the compiled strategy the draft's forwards (catch-up and drafting) run
    the compiled batch step: the same drafts as its eager forwards, so the same
    acceptance, and the target's plain tokens."""
    requests = [greedy(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    plain, _ = run(target, requests)
    got = {}
    for compiled in (False, True):
        runner = BatchRunner(
            target,
            prefill_step_size=16,  # several catch-up chunks per prompt
            stream=mx.new_stream(mx.cpu),
            strategy=ExecutionStrategy.fast_paths(compiled=compiled),
        )
        runner.set_draft(small_draft, target.args.vocab_size)
        runner.num_draft = 3
        step = runner.compiled_draft_step
        assert (step is not None and step.proven) == compiled
        got[compiled] = run_to_max_tokens(runner, requests)
        if compiled:
            assert step.steps > 0
    (eager, eager_stats), (fast, fast_stats) = got[False], got[True]
    assert eager == fast == plain
    assert fast_stats == eager_stats and fast_stats["drafted"] > 0


def test_rows_that_opt_out_or_want_logprobs_or_penalties_ride_along(target, twin_draft) -> None:
    requests = [
        greedy("drafts", PROMPTS[0]),
        greedy("out", PROMPTS[1], speculative=False),
        greedy("logprobs", PROMPTS[2], logprobs=2),
        greedy("penalty", PROMPTS[2][3:], repetition_penalty=1.3),
    ]
    plain, _ = run(target, requests)
    fast, stats = run(target, requests, twin_draft, num_draft=2)
    assert fast == plain
    assert stats["accepted"] > 0


def test_a_prompt_longer_than_a_chunk_drafts_once_the_draft_caught_up(target, twin_draft) -> None:
    requests = [greedy("long", PROMPTS[2] * 4, n=24)]  # 160 tokens, 64-token chunks
    plain, _ = run(target, requests)
    fast, stats = run(target, requests, twin_draft)
    assert fast == plain
    assert stats["accepted"] > 0


def staggered(model, draft, pipelined: bool) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Requests arriving at different steps (the draft prefills each newcomer in
    16-token chunks while the others draft) and leaving at different lengths."""
    runner = BatchRunner(
        model,
        prefill_step_size=16,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(pipelined=pipelined),
    )
    runner.prove_compiled()
    if draft is not None:
        runner.set_draft(draft, model.args.vocab_size)
        runner.num_draft = 3
    arrivals = {0: ("a", PROMPTS[0], 30), 3: ("b", PROMPTS[1], 12), 9: ("c", PROMPTS[2], 25)}
    got: dict[str, list[int]] = {}
    want: dict[str, int] = {}
    for step in range(400):
        if step in arrivals:
            rid, prompt, n = arrivals[step]
            runner.add([greedy(rid, prompt, n)])
            got[rid], want[rid] = [], n
        for out in runner.step():
            if len(got[out.request_id]) < want[out.request_id]:
                got[out.request_id].append(out.token_id)
        runner.remove([rid for rid in got if len(got[rid]) == want[rid]])
        if step > max(arrivals) and all(len(got[r]) == want[r] for r in got):
            break
    stats = runner.speculative_stats()
    runner.close()
    return got, stats


@pytest.mark.parametrize("pipelined", [False, True])
def test_rows_joining_and_leaving_keep_the_draft_cache_in_step(target, twin_draft, pipelined):
    plain, _ = staggered(target, None, pipelined)
    fast, stats = staggered(target, twin_draft, pipelined)
    assert fast == plain
    # Out of step (a row's tokens at another row's positions), the twin would miss.
    assert stats["accepted"] > 0.9 * stats["drafted"] > 0


# -- sampling: the handed-out tokens follow the target's distribution ---------

ROWS = 1000
TOP_K = 4
# A low temperature spreads the random model's near-equal top logits apart
# (p ~ [0.14, 0.2, 0.25, 0.42] at the first token).
TEMPERATURE = 0.1
# The chi-square statistic's 99.9% quantile with 3 degrees of freedom (4 outcomes):
# an exact sampler fails one run in a thousand. Resampling a rejected draft from
# p instead of max(0, p - q) scores ~140 here, keeping every draft far more.
CHI2_3_999 = 16.27


def top_k_softmax(logits: mx.array) -> np.ndarray:
    x = np.array(logits.astype(mx.float32), dtype=np.float64) / TEMPERATURE
    x[np.argsort(x)[:-TOP_K]] = -np.inf
    p = np.exp(x - x.max())
    return p / p.sum()


def chi_square(counts: Counter, p: np.ndarray) -> float:
    n = sum(counts.values())
    support = np.nonzero(p)[0]
    assert set(counts) <= set(support.tolist())  # never a token outside the top k
    return float(sum((counts.get(t, 0) - n * p[t]) ** 2 / (n * p[t]) for t in support))


def sharpened(tiny_models_dir: Path):
    """The target with its output layer scaled up: the same top tokens, other
    probabilities (q sharper than p), so drafts are kept sometimes and resampled
    sometimes (about 40% of the first ones)."""
    draft = load(str(tiny_models_dir / "tiny-llama"))[0]
    draft.lm_head.weight = draft.lm_head.weight * 4.0
    return draft


@pytest.mark.slow
def test_sampled_tokens_follow_the_models_distribution(
    target, tiny_models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every row drafts: the CPU's verify budget would stop a batch this wide.
    monkeypatch.setitem(batch.VERIFY_POSITIONS, "cpu", 10 * ROWS)
    prompt = PROMPTS[1][:12]
    params = {"temperature": TEMPERATURE, "top_k": TOP_K, "max_tokens": 2}
    requests = [
        Request(f"s{i}", tuple(prompt), SamplingParams(seed=i, **params)) for i in range(ROWS)
    ]
    got, stats = run(target, requests, sharpened(tiny_models_dir), num_draft=2)
    assert 0 < stats["accepted"] < stats["drafted"]  # both ways of handing a token out
    first = Counter(tokens[0] for tokens in got.values())
    p_first = top_k_softmax(target(mx.array([prompt]))[0, -1])
    assert chi_square(first, p_first) < CHI2_3_999
    # The second token, after the most frequent first one.
    top = first.most_common(1)[0][0]
    second = Counter(tokens[1] for tokens in got.values() if tokens[0] == top)
    p_second = top_k_softmax(target(mx.array([[*prompt, top]]))[0, -1])
    assert chi_square(second, p_second) < CHI2_3_999


@pytest.mark.slow
def test_smollm2_drafting_for_itself_keeps_its_drafts(smollm2_path: Path) -> None:
    """A draft equal to the target (the built-in SmolLM2, real weights): the
    same text, and nearly every draft kept."""
    model, tokenizer = load(str(smollm2_path))
    draft = load(str(smollm2_path))[0]
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    requests = [greedy("a", prompt, n=24), greedy("b", prompt[:-5], n=24)]
    plain, _ = run(model, requests, prefill_step_size=512)
    fast, stats = run(model, requests, draft, num_draft=3, prefill_step_size=512)
    assert fast == plain
    assert stats["accepted"] > 0.9 * stats["drafted"] > 0
