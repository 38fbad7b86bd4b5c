"""A quantized KV cache (a model's ``kv_bits``, issue 41) on the built-in SmolLM2: its
greedy output is mlx-lm's own with ``kv_bits=8``, its logprobs stay close to
full-precision KV, four requests batched give each one's own
tokens, its KV per token is what the guard counts; and a pool loads a model with it
(the tiny slow-llama: a prefix cache of quantized blocks, the guard's KV measured
quantized, /health's kv_bits)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from omlx.engine.compiled_batch import CompiledSteps
from omlx.engine.engine_status import engine_status
from omlx.engine.kv_measure import cache_bytes_per_token
from omlx.engine.quantized_cache import install
from omlx.engine.runner import BatchRunner
from omlx.engine.strategy import ExecutionStrategy
from omlx.errors import SettingsError
from omlx.mlx_types import prompt_cache
from omlx.models.model_settings import DEFAULT_KV_GROUP_SIZE, KVQuantSpec
from omlx.scheduler import Request, SamplingParams

pytestmark = pytest.mark.slow

# A question the model answers at length (not repeating itself within the answer).
QUESTION = "Explain how a canal lock lets a boat climb a hill, step by step."
# Tokens of its answer the drift is read at.
ANSWER_TOKENS = 160
# Tokens of it that show 4-bit KV drifting further than 8-bit.
PREMISE_TOKENS = 40


def _model(path: Path, bits: int | None, group_size: int = DEFAULT_KV_GROUP_SIZE):
    model, _ = load(str(path))
    if bits is not None:
        install(model, KVQuantSpec(bits, group_size), "smollm2")
    return model


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Callable[[int | None], Any]:
    """SmolLM2 with ``bits``-bit KV (None: full precision), loaded once per setting for
    the module's tests: they only run forwards on it (each with a cache of its own)."""
    loaded: dict[int | None, Any] = {}

    def model(bits: int | None) -> Any:
        if bits not in loaded:
            loaded[bits] = _model(smollm2_path, bits)
        return loaded[bits]

    return model


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    return load(str(smollm2_path))[1]


def _decode_logprobs(
    model, prompt: list[int], answer: list[int] | int
) -> tuple[list[int], mx.array]:
    """The tokens of ``answer`` (given a count: the model's greedy answer of that
    many) and the logprob of each as a request reads them: the prompt in one forward,
    then one token per forward (a quantized cache's first forward attends in full
    precision, every later one over the quantized K/V)."""
    forced = answer if isinstance(answer, list) else None
    n = len(forced) if forced is not None else int(answer)
    cache = prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    tokens: list[int] = []
    logprobs = []
    for i in range(n):
        row = logits.astype(mx.float32)
        row = row - mx.logsumexp(row)
        tokens.append(forced[i] if forced is not None else int(mx.argmax(row)))
        logprobs.append(row[tokens[-1]])
        mx.eval(logprobs[-1])
        if i + 1 < n:
            logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens, mx.stack(logprobs)


def test_8_bit_kv_meets_the_issues_drift_bar(smollm2, tokenizer) -> None:
    """Mean |logprob difference| against full-precision KV over the model's own
    greedy answer (what a client sees), at the default group of 32: the issue's bar,
    0.01 (measured 0.0097; groups of 64 measure 0.0103, over it, and mlx-lm's own
    quantized KV gives our logprobs: test_8_bit_greedy_equals_mlx_lm_kv_bits_8, so
    the drift is 8-bit affine KV's, not our cache's). Prose the model did not write
    drifts further (0.017) and is not the bar's measure: benchmarks/README.md."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    # The answer and its full-precision logprobs in one pass (the tokens mlx-lm's
    # generate_step picks too).
    answer, full = _decode_logprobs(smollm2(None), prompt, ANSWER_TOKENS)
    assert len(set(answer)) > ANSWER_TOKENS // 3  # an answer, not a loop
    drift = mx.abs(_decode_logprobs(smollm2(8), prompt, answer)[1] - full)
    assert mx.mean(drift).item() <= 0.01
    # The cache really is quantized: 4 bits drift further than 8, on the answer's
    # first PREMISE_TOKENS (measured 20x there, 17x over the whole answer).
    head = answer[:PREMISE_TOKENS]
    drift_4 = mx.abs(_decode_logprobs(smollm2(4), prompt, head)[1] - full[:PREMISE_TOKENS])
    assert mx.mean(drift_4).item() > 2 * mx.mean(drift[:PREMISE_TOKENS]).item() > 0


def test_kv_per_token_is_the_quantized_size(smollm2) -> None:
    full = cache_bytes_per_token(smollm2(None))
    assert cache_bytes_per_token(smollm2(8)) <= 0.55 * full
    assert cache_bytes_per_token(smollm2(4)) <= 0.3 * full


def _runner(model, prefill_step_size: int = 16) -> BatchRunner:
    return BatchRunner(
        model,
        prefill_step_size=prefill_step_size,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(pipelined=False),
        compiled=CompiledSteps(),
    )


def _request(i: int, prompt: list[int], n: int) -> Request:
    sampling = SamplingParams(temperature=0.0, max_tokens=n, logprobs=0)
    return Request(f"r{i}", tuple(prompt), sampling)


def _serve(runner: BatchRunner, waves: list[list[Request]], n: int) -> dict[str, list]:
    """Each wave starts after one step of the one before; (token, logprob) per request."""
    got: dict[str, list] = {}
    everyone = [r for wave in waves for r in wave]
    for step in range(400):
        if step < len(waves):
            runner.add(waves[step])
        for t in runner.step():
            assert t.logprobs is not None
            got.setdefault(t.request_id, []).append((t.token_id, t.logprobs.logprob))
        if all(len(got.get(r.request_id, [])) >= n for r in everyone):
            break
    return {rid: out[:n] for rid, out in got.items()}


def _same(one: list, other: list) -> bool:
    """The same tokens, logprobs within 0.05. Not 1e-4 as with full-precision KV:
    rounding to 255 levels turns the ~1e-6 float differences between a one-pass and a
    chunked prefill (or batch shapes) into whole quantization steps for the values at
    a rounding boundary, and those add up over 30 layers (measured up to 0.029 here,
    the size of the 8-bit drift itself; full-precision KV: 5e-6)."""
    tokens = [t for t, _ in one] == [t for t, _ in other]
    return tokens and all(abs(a - b) <= 0.05 for (_, a), (_, b) in zip(one, other, strict=True))


def _mlx_lm_generate(model, prompt: list[int], n: int) -> list:
    """mlx-lm's generate with 8-bit KV from the first token: (token, logprob) per step
    (``model``: one without our ``install``, whose caches mlx-lm's would not be)."""
    steps = generate_step(
        mx.array(prompt), model, max_tokens=n, kv_bits=8, kv_group_size=64, quantized_kv_start=0
    )
    return [(int(t), logprobs[int(t)].item()) for t, logprobs in steps]


def _mlx_lm_one_pass(model, prompt: list[int], n: int) -> list:
    """mlx-lm's caches as its generate uses them (a ``KVCache`` for the first forward,
    ``to_quantized`` after it, ``QuantizedKVCache`` from then on), the whole prompt in
    one forward as our runner feeds it."""
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    cache = [layer.to_quantized(group_size=64, bits=8) for layer in cache]
    out = []
    for _ in range(n):
        logprobs = logits - mx.logsumexp(logits)
        token = int(mx.argmax(logprobs))
        out.append((token, logprobs[token].item()))
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("which", ["smollm2", "slow-llama"])
def test_8_bit_greedy_equals_mlx_lm_kv_bits_8(
    which: str, smollm2, smollm2_path: Path, tiny_models_dir: Path
) -> None:
    """Ours against mlx-lm's own quantized KV: the same tokens as its ``generate_step``
    (``kv_bits=8, quantized_kv_start=0``), and the same logprobs as its caches fed the
    way our runner feeds them. Its generate feeds the prompt's last token in a forward
    of its own, which attends over the quantized cache (ours: in the prompt's one
    forward), so its logprobs differ from ours by up to 0.06 on SmolLM2 (0.0006 on the
    tiny model); driven in the same passes they are equal."""
    path = smollm2_path if which == "smollm2" else tiny_models_dir / "slow-llama"
    model, tokenizer = load(str(path))
    install(model, KVQuantSpec(8, 64), which)
    prompt, n = tokenizer.encode(QUESTION), 40
    ours = _serve(_runner(model, prefill_step_size=512), [[_request(0, prompt, n)]], n)["r0"]
    plain = smollm2(None) if which == "smollm2" else load(str(path))[0]
    generated = _mlx_lm_generate(plain, prompt, n)
    assert [t for t, _ in ours] == [t for t, _ in generated]
    assert max(abs(a - b) for (_, a), (_, b) in zip(ours, generated, strict=True)) < 0.1
    same_passes = _mlx_lm_one_pass(plain, prompt, n)
    assert [t for t, _ in ours] == [t for t, _ in same_passes]
    assert max(abs(a - b) for (_, a), (_, b) in zip(ours, same_passes, strict=True)) < 1e-5


def test_four_at_once_equal_each_alone(smollm2, tokenizer) -> None:
    model, n = smollm2(8), 12
    texts = [
        "The capital of France is",
        "Once upon a time, in a land far away, there lived a",
        "def fibonacci(n):",
        "List three colours: red,",
    ]
    requests = [_request(i, tokenizer.encode(t), n) for i, t in enumerate(texts)]
    alone: dict[str, list] = {}
    for r in requests:
        alone.update(_serve(_runner(model), [[r]], n))
    together = _serve(_runner(model), [requests], n)
    # One alone, the others arriving while it decodes: it moves into the batch.
    joined = _serve(_runner(model), [requests[:1], requests[1:]], n)
    for r in requests:
        rid = r.request_id
        assert _same(together[rid], alone[rid]), rid
        assert _same(joined[rid], alone[rid]), rid


def test_a_pool_serves_the_model_with_quantized_kv(make_pool) -> None:
    """The pool's load on the tiny slow-llama (the same load path as SmolLM2's, whose
    profile measurement would cost this test half a minute; the built-in model served
    with 8-bit KV: tests/api/test_kv_quant_api.py)."""
    pool = make_pool(cache={"enabled": True})
    pool.model_settings.put("slow-llama", {"kv_bits": 8})

    async def main() -> None:
        engine = await pool.get_engine("slow-llama")
        assert engine.kv_quant == KVQuantSpec(8, 32)
        # Its prefix cache holds quantized blocks (tests/integration/test_kv_quant_cache.py).
        assert engine.prefix_cache is not None
        assert set(engine.prefix_cache.layout) == {"quantized:8:32"}
        model = engine.loaded.model
        assert engine.guard.dims.kv_bytes_per_token == cache_bytes_per_token(model)
        assert cache_bytes_per_token(model) <= 0.55 * cache_bytes_per_token(model, full=True)
        assert engine_status(engine)["kv_bits"] == 8

    asyncio.run(main())


def test_a_group_size_the_heads_cannot_split_is_refused(make_pool, tiny_models_dir) -> None:
    """tiny-llama's heads have 16 dimensions: groups of 32 (the default) cannot
    quantize them."""
    pool = make_pool(fresh_profile=True)
    pool.model_settings.put("tiny-llama", {"kv_bits": 8})
    with pytest.raises(SettingsError, match="kv_group_size: 32 does not divide"):
        asyncio.run(pool.get_engine("tiny-llama"))


def test_a_model_that_cannot_attend_over_quantized_kv_is_refused() -> None:
    """gemma4's KV-shared layers attend over an earlier layer's K/V as plain arrays
    (mlx-lm's own quantized KV fails there too). Its first forward attends in full
    precision and passes; the check at load runs a second, and refuses the setting."""
    from mlx_lm.models import gemma4_text

    args = gemma4_text.ModelArgs(
        hidden_size=64,
        num_hidden_layers=6,
        sliding_window_pattern=2,
        intermediate_size=64,
        num_attention_heads=2,
        head_dim=32,
        global_head_dim=64,
        vocab_size=128,
        vocab_size_per_layer_input=128,
        num_key_value_heads=1,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        sliding_window=16,
    )
    with pytest.raises(SettingsError, match="kv_bits: gemma4 cannot run with a quantized KV"):
        install(gemma4_text.Model(args), KVQuantSpec(8, 32), "gemma4")
