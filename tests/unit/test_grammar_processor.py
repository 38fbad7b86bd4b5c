"""The grammar logits processor: the greedy fast path picks what the full mask picks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from omlx.grammar.compiler import GrammarCompiler
from omlx.grammar.processor import GrammarLogitsProcessor, greedy_draw, temperature_draw
from omlx.grammar.spec import GrammarSpec
from tests.fixtures.tiny_models import train_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
        "n": {"type": "integer"},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}
SPEC = GrammarSpec.json_schema(SCHEMA, strict=True, param="response_format")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    out: Path = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def compiler(hf_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [hf_tokenizer.eos_token_id])


def _allowed(compiler: GrammarCompiler, matcher: Any) -> np.ndarray:
    words = (compiler.vocab_size + 31) // 32
    mask = np.zeros((1, words), dtype=np.int32)
    matcher.fill_next_token_bitmask(mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: compiler.vocab_size]
    return np.flatnonzero(bits)


def _decode_side_by_side(compiler: GrammarCompiler, seed: int, steps: int = 120) -> tuple:
    """Feed the same logits to a greedy fast-path processor and a full-mask one.

    The fake model prefers an allowed token on most steps and a forbidden one on
    the others (the end token too), so both of the fast path's branches run.
    """
    compiled = compiler.compile(SPEC)
    fast = GrammarLogitsProcessor(compiler.matcher(compiled), compiler.vocab_size, draw=greedy_draw)
    full = GrammarLogitsProcessor(compiler.matcher(compiled), compiler.vocab_size)
    oracle = compiler.matcher(compiled)
    sample = make_sampler(temp=0.0)
    rng = np.random.default_rng(seed)
    context = [1, 2, 3]
    out: list[int] = []
    for _ in range(steps):
        if oracle.is_terminated():
            break
        logits = rng.normal(size=compiler.vocab_size).astype(np.float32)
        allowed = _allowed(compiler, oracle)
        if rng.random() < 0.7:
            logits[rng.choice(allowed)] += 8.0
        else:
            logits[rng.choice(np.setdiff1d(np.arange(compiler.vocab_size), allowed))] += 8.0
        row = mx.array(logits)[None]
        picks = []
        for processor in (fast, full):
            processed = processor(mx.array(context), row)
            picks.append(int(sample(processed - mx.logsumexp(processed, keepdims=True)).item()))
        assert picks[0] == picks[1], f"step {len(out)}: fast path {picks[0]} != mask {picks[1]}"
        assert oracle.accept_token(picks[0])
        context.append(picks[0])
        out.append(picks[0])
    return out, fast, full


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_fast_path_picks_exactly_what_the_full_mask_picks(
    compiler: GrammarCompiler, hf_tokenizer: Any, seed: int
) -> None:
    out, fast, full = _decode_side_by_side(compiler, seed)
    # Both branches ran, and the fast path spared most of the vocabulary masks.
    assert fast.num_fast > 0 and fast.num_fills > 0
    assert fast.num_fills < full.num_fills
    text = hf_tokenizer.decode(out, skip_special_tokens=True)
    assert out[-1] == hf_tokenizer.eos_token_id  # the grammar ended the document
    # strict=False: this toy tokenizer's byte tokens decode to control characters.
    value = json.loads(text, strict=False)
    assert set(value) == {"name", "tags", "n"} and set(value["tags"]) <= {"a", "bb"}


def test_fast_path_recovers_when_the_sample_is_not_its_choice(compiler: GrammarCompiler) -> None:
    """If something after the processor changes the pick, the matcher follows the
    token really sampled (never a state the output does not have)."""
    compiled = compiler.compile(SPEC)
    fast = GrammarLogitsProcessor(compiler.matcher(compiled), compiler.vocab_size, draw=greedy_draw)
    reference = compiler.matcher(compiled)
    allowed = _allowed(compiler, reference)
    assert len(allowed) >= 2
    logits = np.zeros(compiler.vocab_size, dtype=np.float32)
    logits[allowed[0]] = 5.0
    fast(mx.array([1]), mx.array(logits)[None])  # fast path accepts allowed[0] ahead
    # ...but allowed[1] is what got sampled: it must be the matcher's history.
    fast(mx.array([1, int(allowed[1])]), mx.array(logits)[None])
    assert reference.accept_token(int(allowed[1]))
    assert np.array_equal(_allowed(compiler, fast._matcher), _allowed(compiler, reference))


def test_temperature_fast_path_samples_the_masked_distribution(
    compiler: GrammarCompiler, hf_tokenizer: Any
) -> None:
    """Rejection sampling: a draw the grammar refuses falls back to the mask, so
    each allowed token comes out with its softmax share of the allowed mass."""
    from omlx.engine.sampling import make_request_sampler
    from omlx.scheduler import SamplingParams

    compiled = compiler.compile(GrammarSpec.choice(["a", "b", "c", "d"], "structured_outputs"))
    allowed = _allowed(compiler, compiler.matcher(compiled))
    assert len(allowed) == 4
    rng = np.random.default_rng(0)
    logits = rng.normal(size=compiler.vocab_size).astype(np.float32) - 6.0
    logits[allowed] = [1.0, 0.0, -1.0, 0.5]
    # About half the mass on forbidden tokens: both paths run about half the time.
    logits[rng.choice(np.setdiff1d(np.arange(compiler.vocab_size), allowed), 3)] = 0.6
    expected = np.exp(logits[allowed]) / np.exp(logits[allowed]).sum()
    row = mx.array(logits)[None]
    trials, counts, fast_hits = 3000, dict.fromkeys(allowed.tolist(), 0), 0
    for i in range(trials):
        params = SamplingParams(temperature=1.0, seed=i)
        processor = GrammarLogitsProcessor(
            compiler.matcher(compiled), compiler.vocab_size, draw=temperature_draw(1.0, i)
        )
        processed = processor(mx.array([1]), row)
        token = int(make_request_sampler(params)(processed - mx.logsumexp(processed)).item())
        counts[token] += 1  # a forbidden token would be a KeyError
        fast_hits += processor.num_fast
    assert 0.3 * trials < fast_hits < 0.7 * trials
    observed = np.array([counts[t] for t in allowed.tolist()])
    chi2 = (((observed - trials * expected) ** 2) / (trials * expected)).sum()
    assert chi2 < 16.3, (observed, trials * expected)  # p = 0.001 at 3 degrees of freedom


@pytest.mark.parametrize("seed", [-1, 2**64 + 5, 0])
def test_any_integer_seed_reproduces_its_tokens(seed: int) -> None:
    """Clients send -1 or values past 64 bits; MLX keys take a uint64. Any integer
    must sample (not fail the engine step) and reproduce itself."""
    from omlx.engine.sampling import make_request_sampler
    from omlx.scheduler import SamplingParams

    logprobs = mx.log(mx.softmax(mx.array(np.linspace(0.0, 3.0, 64, dtype=np.float32))[None]))
    row = mx.array(np.linspace(0.0, 3.0, 64, dtype=np.float32))[None]

    def run() -> tuple[list[int], list[int]]:
        sample = make_request_sampler(SamplingParams(temperature=1.0, seed=seed))
        draw = temperature_draw(1.0, seed)
        return [int(sample(logprobs).item()) for _ in range(16)], [draw(row) for _ in range(16)]

    first = run()
    assert first == run()
    assert len(set(first[0])) > 1  # really sampling
