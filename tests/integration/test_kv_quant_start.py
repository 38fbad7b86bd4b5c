"""A quantized KV cache that starts after N tokens (a model's ``quantized_kv_start``,
mlx-lm's name and semantics, issue 41) on the built-in SmolLM2 and the tiny slow-llama.

Alone, a sequence is mlx-lm's own ``generate_step(kv_bits=8, quantized_kv_start=N)``
token for token, whether its prompt crosses N or its decoding does; four at once
finish with the batch's documented semantics (the batch quantizes when its longest
row reaches N, every row then); the caches' kinds never mix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache

from omlx.engine.kv_measure import cache_bytes_per_token, with_kv_start
from omlx.engine.quantized_cache import QuantizedLayer, install
from omlx.memory.dims import ModelDims
from omlx.models.model_settings import KVQuantSpec
from tests.integration.test_kv_quant import QUESTION, _request, _runner, _same, _serve

pytestmark = pytest.mark.slow

START = 16


@pytest.fixture(scope="module")
def plain(smollm2_path: Path, tiny_models_dir: Path) -> Callable[[str], tuple[Any, Any]]:
    """(model, tokenizer) of "smollm2" or "slow-llama" without our ``install`` (what
    mlx-lm's own quantized KV runs on), loaded once for the module: the references
    only run forwards on it, each with caches of its own."""
    loaded: dict[str, tuple[Any, Any]] = {}

    def get(which: str) -> tuple[Any, Any]:
        if which not in loaded:
            path = smollm2_path if which == "smollm2" else tiny_models_dir / "slow-llama"
            loaded[which] = load(str(path))[:2]
        return loaded[which]

    return get


@pytest.fixture(scope="module")
def tokenizer(plain):
    return plain("smollm2")[1]


def _mlx_lm_generate(model, prompt: list[int], n: int, start: int, group: int = 64) -> list:
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=n,
        kv_bits=8,
        kv_group_size=group,
        quantized_kv_start=start,
    )
    return [(int(t), logprobs[int(t)].item()) for t, logprobs in steps]


def _mlx_lm_one_pass(model, prompt: list[int], n: int, start: int) -> list:
    """mlx-lm's caches quantized by its own ``maybe_quantize_kv_cache`` after every
    forward, the whole prompt in one forward as our runner feeds it."""
    cache = [KVCache() for _ in model.layers]
    out, feed = [], mx.array(prompt)[None]
    for _ in range(n):
        logits = model(feed, cache=cache)[0, -1]
        maybe_quantize_kv_cache(cache, start, 64, 8)
        logprobs = logits - mx.logsumexp(logits)
        token = int(mx.argmax(logprobs))
        out.append((token, logprobs[token].item()))
        feed = mx.array([[token]])
    assert all(not isinstance(layer, KVCache) for layer in cache)  # it did quantize
    return out


@pytest.mark.parametrize("which", ["smollm2", "slow-llama"])
@pytest.mark.parametrize("prompt_kind", ["long", "short"])
def test_alone_equals_mlx_lm_with_quantized_kv_start(
    which: str, prompt_kind: str, smollm2_path: Path, tiny_models_dir: Path, plain
) -> None:
    """A prompt past N (quantized after its prefill) and one shorter than N (its
    decoding crosses N): mlx-lm's tokens from its generate, and its logprobs from its
    caches fed in our passes (its generate feeds the prompt's last token in a forward
    of its own: test_kv_quant.py's test_8_bit_greedy_equals_mlx_lm_kv_bits_8)."""
    path = smollm2_path if which == "smollm2" else tiny_models_dir / "slow-llama"
    model, its_tokenizer = load(str(path))
    install(model, KVQuantSpec(8, 64, START), which)
    prompt = its_tokenizer.encode(f"{QUESTION} {QUESTION}")
    if prompt_kind == "short":
        prompt = prompt[:6]
    assert (len(prompt) > START) == (prompt_kind == "long")
    # 24 tokens: the short prompt's decoding crosses N with 13 of them left to read
    # over the quantized cache (a mismatch shows at the first: logprobs within 1e-5).
    n = 24
    assert len(prompt) + n >= START + 8
    ours = _serve(_runner(model, prefill_step_size=512), [[_request(0, prompt, n)]], n)["r0"]
    reference = plain(which)[0]
    generated = _mlx_lm_generate(reference, prompt, n, START)
    assert [t for t, _ in ours] == [t for t, _ in generated]
    same_passes = _mlx_lm_one_pass(reference, prompt, n, START)
    assert [t for t, _ in ours] == [t for t, _ in same_passes]
    assert max(abs(a - b) for (_, a), (_, b) in zip(ours, same_passes, strict=True)) < 1e-5


def test_a_solo_layer_stays_full_precision_until_n_then_quantized(smollm2_path: Path) -> None:
    model, _ = load(str(smollm2_path))
    install(model, KVQuantSpec(8, 32, START), "smollm2")
    cache = model.make_cache()
    mx.eval(model(mx.arange(1, 11)[None], cache=cache))
    assert all(isinstance(layer, QuantizedLayer) and not layer.quantized for layer in cache)
    assert not hasattr(cache[0], "bits")  # its attention is mlx-lm's plain one
    for token in range(5):  # 15 tokens: still full precision
        mx.eval(model(mx.array([[token + 20]]), cache=cache))
    assert not cache[0].quantized
    mx.eval(model(mx.array([[40]]), cache=cache))  # the 16th: quantized after it
    assert all(layer.quantized and layer.offset == START for layer in cache)
    mx.eval(model(mx.array([[41]]), cache=cache))
    assert cache[0].bits == 8 and isinstance(cache[0].keys, tuple)


TEXTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "List three colours: red,",
]


def _installed(path: Path, start: int):
    model = load(str(path))[0]
    install(model, KVQuantSpec(8, 32, start), "smollm2")
    return model


def test_four_at_once_quantize_when_the_longest_row_reaches_n(
    smollm2_path: Path, tokenizer
) -> None:
    """Four prompts shorter than N = 16, at once: the batch quantizes every row at the
    step its longest row reaches 16 (README, "quantized_kv_start"), so a row ``d`` tokens
    shorter than the longest is quantized at 16 - d tokens: each row answers as it
    does alone with N = 16 - d."""
    n = 24
    requests = [_request(i, tokenizer.encode(t), n) for i, t in enumerate(TEXTS)]
    longest = max(r.num_prompt_tokens for r in requests)
    assert longest < START
    model = _installed(smollm2_path, START)
    together = _serve(_runner(model), [requests], n)
    # One alone, the others arriving while it decodes: its cache moves into theirs
    # (a full-precision or quantized row meeting the others' full-precision ones).
    joined = _serve(_runner(model), [requests[:1], requests[1:]], n)
    assert sorted(joined) == sorted(together)
    assert all(len(tokens) == n for tokens in joined.values())
    for r in requests:
        start = START - (longest - r.num_prompt_tokens)
        alone = _serve(_runner(_installed(smollm2_path, start)), [[r]], n)
        assert len(together[r.request_id]) == n
        assert _same(together[r.request_id], alone[r.request_id]), (r.request_id, start)


def test_a_row_joining_a_quantized_batch_is_quantized_as_it_joins(
    smollm2_path: Path, tokenizer, plain
) -> None:
    """Three rows decode past N; a fourth arrives: its prompt is prefilled in full
    precision (all but its last token, as every batch row's) and quantized as it joins
    the batch, so it answers as mlx-lm's generate with N = its prompt length - 1 (which
    quantizes after that same prefill)."""
    model = _installed(smollm2_path, START)
    first = [_request(i, tokenizer.encode(t), 40) for i, t in enumerate(TEXTS[:3])]
    late = _request(3, tokenizer.encode(TEXTS[3]), 24)
    runner, got = _runner(model), {}
    runner.add(first)
    for _ in range(400):
        if len(got.get("r0", [])) == START:
            runner.add([late])
        for t in runner.step():
            got.setdefault(t.request_id, []).append((t.token_id, t.logprobs.logprob))
        if len(got.get("r3", [])) >= 24:
            break
    ours = got["r3"][:24]
    reference = _mlx_lm_generate(
        plain("smollm2")[0], list(late.prompt_ids), 24, late.num_prompt_tokens - 1, 32
    )
    assert [t for t, _ in ours] == [t for t, _ in reference]


def test_the_guards_price_bounds_what_the_cache_holds_across_n(tiny_models_dir: Path) -> None:
    """The guard's per-token figures are the cache's own (full precision: a plain
    ``KVCache``'s; quantized: what it stores), and its price for a sequence fed in
    chunks of 8 with N = 20 bounds what the cache holds at every forward, the one that
    quantizes (both copies alive) included."""
    path = tiny_models_dir / "slow-llama"
    plain = load(str(path))[0]
    model = load(str(path))[0]
    install(model, KVQuantSpec(8, 32, 20), "slow-llama")
    full = cache_bytes_per_token(plain)
    assert cache_bytes_per_token(model, full=True) == full
    quantized = cache_bytes_per_token(model)
    assert quantized < 0.55 * full
    base = ModelDims(4, 1, 64, 4, 256, measured_kv_bytes_per_token=quantized)
    dims = with_kv_start(base, model, 20, rows=1, chunk_tokens=8)
    assert dims.kv_bytes(10) == quantized * 10 + full * 10
    cache, fed = model.make_cache(), 0
    for _ in range(5):
        before, was_quantized = _held_bytes(cache), cache[0].quantized
        mx.eval(model(mx.arange(fed + 1, fed + 9)[None], cache=cache))
        fed += 8
        held = _held_bytes(cache)
        if cache[0].quantized and not was_quantized:
            # The forward that quantized: its full-precision K/V (the tokens held
            # before it and its own 8) beside the quantized copy.
            held += before + full * 8
        assert held <= dims.kv_bytes(fed), (fed, held, dims.kv_bytes(fed))
    assert cache[0].quantized


def _held_bytes(cache: list) -> int:
    """The bytes of the tokens the cache holds (not its buffers' spare room)."""
    return sum(
        a.nbytes
        for layer in cache
        if layer.keys is not None
        for kv in (layer.keys, layer.values)
        for a in (kv if isinstance(kv, tuple) else (kv,))
        for a in [a[..., : layer.offset, :]]
    )
