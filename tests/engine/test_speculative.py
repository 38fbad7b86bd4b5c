"""Speculative decoding in the runner: the same greedy tokens as without it, on
tiny random models and on the built-in SmolLM2, with drafts really accepted."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from omlx.engine.runner import BatchRunner
from omlx.engine.strategy import ExecutionStrategy
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.speculation import run_to_max_tokens
from tests.fixtures.tiny_models import build_tiny_model

# Prompts that repeat themselves: a random model's greedy output then repeats
# pieces of them too, so the n-gram drafter's guesses get accepted.
PROMPTS = [list(range(3, 40)) * 3, list(range(50, 71)) * 2, list(range(90, 100)) * 4]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def model(request, tiny_models_dir: Path):
    return load(str(tiny_models_dir / request.param))[0]


def run(
    model,
    requests: list[Request],
    num_draft: int,
    prefill_step_size: int = 64,
    pipelined: bool = False,
    compiled: bool = True,
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Every token each request got until it reached its max_tokens, and the
    runner's speculative counters."""
    runner = BatchRunner(
        model,
        prefill_step_size=prefill_step_size,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(compiled=compiled, pipelined=bool(pipelined)),
    )
    runner.prove_compiled()
    runner.num_draft = num_draft
    return run_to_max_tokens(runner, requests)


def greedy(rid: str, prompt: list[int], n: int = 40, **kw) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=n, **kw))


def test_a_lone_request_gets_the_same_tokens_in_fewer_steps(model) -> None:
    requests = [greedy("a", PROMPTS[0])]
    plain, _ = run(model, requests, num_draft=0)
    fast, stats = run(model, requests, num_draft=4)
    assert fast == plain
    assert stats["accepted"] > 0
    assert stats["tokens"] > stats["row_steps"]  # more than one token per row and step


def test_a_lone_request_speculates_without_compiled_steps(model) -> None:
    """Without the compiled batch step, a lone request still leaves its solo
    sequence after its first token for the batch, the path that drafts."""
    requests = [greedy("a", PROMPTS[0])]
    plain, _ = run(model, requests, num_draft=0, compiled=False)
    fast, stats = run(model, requests, num_draft=4, compiled=False)
    assert fast == plain
    assert stats["accepted"] > 0 and stats["tokens"] > stats["row_steps"]


def test_a_batch_gets_each_rows_own_tokens(model) -> None:
    requests = [greedy(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    plain, _ = run(model, requests, num_draft=0)
    fast, stats = run(model, requests, num_draft=3)
    assert fast == plain
    assert stats["accepted"] > 0


def test_pipelined_batches_hand_out_every_token_once_when_speculation_starts(model) -> None:
    """On a GPU the batch queues its next forward before handing tokens out; a
    speculative step first hands out the tokens such a step left pending."""
    requests = [greedy(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    plain, _ = run(model, requests, num_draft=0, pipelined=True)
    fast, stats = run(model, requests, num_draft=4, pipelined=True)
    assert fast == plain
    assert stats["accepted"] > 0


def test_a_batch_past_the_backends_budget_drafts_less_then_not_at_all(model) -> None:
    """On the CPU backend a speculative forward may verify 10 positions in all:
    one row drafts 4 (5 positions), four rows 1 each, eight rows none."""
    prompts = [PROMPTS[0][i : i + 60] for i in range(8)]  # prefilled in one chunk
    for rows, most in ((1, 4), (4, 1), (8, 0)):
        requests = [greedy(f"r{i}", p, n=24) for i, p in enumerate(prompts[:rows])]
        plain, _ = run(model, requests, num_draft=0)
        fast, stats = run(model, requests, num_draft=4)
        assert fast == plain
        assert stats["drafted"] <= most * stats["row_steps"]
        assert (stats["drafted"] > 0) == (most > 0)


def test_models_whose_cache_cannot_be_cut_decode_without_drafts(tmp_path: Path) -> None:
    lfm2 = load(str(build_tiny_model(tmp_path / "tiny-lfm2", "lfm2", seed=4)))[0]
    requests = [greedy(f"r{i}", p, n=12) for i, p in enumerate(PROMPTS)]
    plain, _ = run(lfm2, requests, num_draft=0)
    fast, stats = run(lfm2, requests, num_draft=4)
    assert fast == plain
    assert stats["drafted"] == 0


def test_rows_that_opt_out_or_want_logprobs_ride_along_unchanged(model) -> None:
    requests = [
        greedy("drafts", PROMPTS[0]),
        greedy("out", PROMPTS[1], speculative=False),
        greedy("logprobs", PROMPTS[2], logprobs=2),
    ]
    plain, _ = run(model, requests, num_draft=0)
    fast, stats = run(model, requests, num_draft=4)
    assert fast == plain
    assert 0 < stats["accepted"] <= stats["drafted"]


def test_repetition_penalty_applies_at_every_drafted_position(model) -> None:
    requests = [greedy(f"r{i}", p, repetition_penalty=1.3) for i, p in enumerate(PROMPTS)]
    plain, _ = run(model, requests, num_draft=0)
    fast, stats = run(model, requests, num_draft=4)
    assert fast == plain
    assert stats["drafted"] > 0


CODE = """class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        self.counts[word] = self.counts.get(word, 0) + 1

    def top(self, n):
        return sorted(self.counts, key=self.counts.get, reverse=True)[:n]
"""


@pytest.mark.slow
def test_smollm2_returns_an_edited_file_token_for_token(smollm2_path: Path) -> None:
    model, tokenizer = load(str(smollm2_path))
    messages = [
        {
            "role": "user",
            "content": f"Rename the method add to add_word and return the whole file:\n\n{CODE}",
        }
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    requests = [greedy("edit", prompt, n=40), greedy("other", prompt[:-9], n=40)]
    plain, _ = run(model, requests, num_draft=0, prefill_step_size=512)
    fast, stats = run(model, requests, num_draft=4, prefill_step_size=512)
    assert fast == plain
    # The answer copies the file: most drafts are kept.
    assert stats["accepted"] > 0


def test_a_seed_gives_the_same_sampled_tokens_with_or_without_drafts(model) -> None:
    """Each drafted position is drawn as the plain step draws it, with the same key:
    a seeded request's output does not depend on speculation (nor, so, on a
    preemption that resumes it with a different draft history)."""
    requests = [
        Request(
            f"s{i}", tuple(p), SamplingParams(temperature=0.5, top_k=4, seed=9 + i, max_tokens=40)
        )
        for i, p in enumerate(PROMPTS)
    ]
    plain, _ = run(model, requests, num_draft=0)
    fast, stats = run(model, requests, num_draft=4)
    assert fast == plain
    assert stats["accepted"] > 0
