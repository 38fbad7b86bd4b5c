"""A lone request's decode step runs as one compiled graph (omlx/engine/compiled.py),
on real (tiny, random) mlx-lm models: the same tokens as mlx-lm's own loop, on
caches that stay plain ``KVCache`` objects the batch and the prefix cache take over."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx.engine.compiled import CompiledDecode, qualifies
from omlx.engine.runner import BatchRunner
from omlx.engine.sampling import make_request_sampler
from omlx.engine.solo import SoloSequence
from omlx.engine.strategy import ExecutionStrategy
from omlx.scheduler import Request, SamplingParams
from tests.fixtures.tiny_models import build_tiny_model


def reference(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for token, _ in steps]


def make_runner(model, compiled: bool = True) -> BatchRunner:
    return BatchRunner(
        model,
        prefill_step_size=64,
        stream=mx.new_stream(mx.cpu),
        strategy=ExecutionStrategy.fast_paths(compiled=compiled),
    )


def request(rid: str, prompt: list[int], n: int) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=n))


def tokens_of(runner: BatchRunner, rid: str, n: int, max_steps: int = 200) -> list[int]:
    out: list[int] = []
    for _ in range(max_steps):
        out += [t.token_id for t in runner.step() if t.request_id == rid]
        if len(out) >= n:
            return out[:n]
    raise AssertionError(f"{rid}: {len(out)} of {n} tokens")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_a_lone_request_decodes_compiled_with_mlx_lms_tokens_across_a_buffer_growth(
    tiny_models_dir: Path, name: str
) -> None:
    model, _ = load(str(tiny_models_dir / name))
    # 250 prompt tokens + 20 decoded: the 256-token buffer grows mid-decode.
    prompt = [(7 * i) % 200 + 3 for i in range(250)]
    runner = make_runner(model)
    runner.add([request("a", prompt, 20)])
    assert tokens_of(runner, "a", 20) == reference(model, prompt, 20)
    decoder = runner.compiled_decoder
    assert decoder is not None and not decoder.failed
    # Every decode step after the first ran compiled (less the one in flight).
    assert decoder.steps >= 17


def test_a_compiled_sequence_joins_the_batch_with_its_cache(tiny_models_dir: Path) -> None:
    """A second request arrives mid-decode: the solo sequence moves into the batch
    with the buffers the compiled step wrote, and both continue as mlx-lm would."""
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    first = [(5 * i) % 150 + 2 for i in range(40)]
    second = [(3 * i) % 120 + 9 for i in range(30)]
    runner = make_runner(model)
    runner.add([request("a", first, 24)])
    got = tokens_of(runner, "a", 10)
    assert runner.compiled_decoder is not None and runner.compiled_decoder.steps > 0
    runner.add([request("b", second, 12)])
    got_a: list[int] = list(got)
    got_b: list[int] = []
    for _ in range(100):
        for t in runner.step():
            (got_a if t.request_id == "a" else got_b).append(t.token_id)
        if len(got_a) >= 24 and len(got_b) >= 12:
            break
    assert got_a[:24] == reference(model, first, 24)
    assert got_b[:12] == reference(model, second, 12)


def test_the_cache_stays_a_kv_cache_mlx_lm_can_continue(tiny_models_dir: Path) -> None:
    """After compiled steps each layer is a KVCache at the right offset, whose
    contents equal an eagerly fed cache's: mlx-lm continues from it unchanged."""
    model, _ = load(str(tiny_models_dir / "tiny-qwen3"))
    prompt = [(11 * i) % 180 + 4 for i in range(60)]
    decoder = CompiledDecode(model)
    compiled = make_prompt_cache(model)
    eager = make_prompt_cache(model)
    for cache in (compiled, eager):
        model(mx.array(prompt)[None], cache=cache)
    token = mx.array([17])
    for _ in range(5):
        logits = decoder(token, compiled)
        assert logits is not None
        want = model(token[None], cache=eager)[:, -1, :]
        assert mx.allclose(logits, want, atol=1e-4).item()
        token = mx.argmax(want, axis=-1)
    for c, e in zip(compiled, eager, strict=True):
        assert type(c) is KVCache and c.offset == e.offset == 65
        assert mx.allclose(c.state[0], e.state[0], atol=1e-5).item()
        assert mx.allclose(c.state[1], e.state[1], atol=1e-5).item()
    a = model(mx.array([[token.item()]]), cache=compiled)
    b = model(mx.array([[token.item()]]), cache=eager)
    assert mx.allclose(a, b, atol=1e-4).item()


def test_models_the_compiled_step_does_not_know_decode_eagerly(tmp_path: Path) -> None:
    # A RoPE that does Python arithmetic on the offset, and another architecture.
    dynamic = build_tiny_model(
        tmp_path / "dyn", "llama", seed=3, rope_scaling={"type": "dynamic", "factor": 2.0}
    )
    gemma = build_tiny_model(tmp_path / "g", "gemma3_text", seed=4)
    for path in (dynamic, gemma):
        model, _ = load(str(path))
        assert not qualifies(model)
        runner = make_runner(model)
        assert runner.compiled_decoder is None
        prompt = [(13 * i) % 100 + 5 for i in range(20)]
        runner.add([request("a", prompt, 6)])
        assert tokens_of(runner, "a", 6) == reference(model, prompt, 6)


def test_llama3_rope_scaling_qualifies_and_matches(tmp_path: Path) -> None:
    path = build_tiny_model(
        tmp_path / "l3",
        "llama",
        seed=5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    model, _ = load(str(path))
    assert qualifies(model)
    prompt = [(13 * i) % 100 + 5 for i in range(90)]
    runner = make_runner(model)
    runner.add([request("a", prompt, 12)])
    assert tokens_of(runner, "a", 12) == reference(model, prompt, 12)
    assert runner.compiled_decoder is not None and runner.compiled_decoder.steps >= 9


def test_a_step_that_cannot_be_traced_leaves_the_sequence_decoding_eagerly(
    tmp_path: Path,
) -> None:
    """Forced onto a model whose RoPE needs a Python offset, the compiled step
    fails its first run on a scratch cache; the sequence's own cache is never
    touched by it and decodes eagerly, as mlx-lm would."""
    path = build_tiny_model(
        tmp_path / "dyn", "llama", seed=3, rope_scaling={"type": "dynamic", "factor": 2.0}
    )
    model, _ = load(str(path))
    decoder = CompiledDecode(model)
    prompt = [(13 * i) % 100 + 5 for i in range(20)]
    greedy = make_request_sampler(SamplingParams(temperature=0.0, max_tokens=8))
    sequence = SoloSequence(model, "a", prompt, greedy, [], 64, decoder=decoder)
    got: list[int] = []
    while len(got) < 8:
        token = sequence.step()
        if token is not None:
            got.append(token)
    assert got == reference(model, prompt, 8)
    assert decoder.failed and decoder.steps == 0


def test_each_step_writes_its_token_into_the_buffers_in_place(tiny_models_dir: Path) -> None:
    """No step copies the cache, not even the one that traces a new buffer size:
    a copy would hold a long context's KV twice for a moment."""
    model, _ = load(str(tiny_models_dir / "tiny-llama"))
    decoder = CompiledDecode(model)
    cache = make_prompt_cache(model)
    model(mx.array([[(7 * i) % 200 + 3 for i in range(1016)]]), cache=cache)
    token = mx.array([5])
    logits = decoder(token, cache)  # the scratch run and this buffer size's trace
    assert logits is not None
    token = mx.argmax(logits, axis=-1)
    mx.eval(token, [c.state for c in cache])
    assert cache[0].keys.shape[2] == 1024
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for _ in range(16):  # 1017 -> 1033 tokens: the buffer grows to 1280 on the way
        logits = decoder(token, cache)
        assert logits is not None
        token = mx.argmax(logits, axis=-1)
        mx.eval(token)
    grown = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert cache[0].offset == 1033 and cache[0].keys.shape[2] == 1280
    # Growing allocates the new buffers once (the old ones are freed after); a
    # copy by any step would allocate them again.
    assert mx.get_peak_memory() - before < 1.5 * grown
