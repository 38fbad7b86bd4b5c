"""The guard's KV per token is read from the model's own cache (issue 41, defect 5),
with real tiny mlx-lm models: a plain attention model's figure is the config's; a
hybrid's counts only its attention layers; a state-space model's config names no
attention heads (the config dims fall back to a 70B-class guess) and its cache does
not grow with the prompt at all."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from mlx_lm import load

from omlx.engine.kv_measure import cache_bytes_per_token
from omlx.memory.dims import guard_dims, model_dims
from tests.fixtures.tiny_models import ARCH_CONFIGS, build_tiny_model

F32 = 4  # the tiny models' weights (and so their KV) are float32


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kv-measure")
    for arch in ("qwen3", "lfm2", "gemma3_text", "mamba"):
        build_tiny_model(root / arch, arch)
    return root


def _measured(models: Path, arch: str) -> int:
    model, _ = load(str(models / arch))
    return cache_bytes_per_token(model)


def test_an_attention_model_grows_by_its_config_s_kv(models: Path) -> None:
    dims = model_dims(ARCH_CONFIGS["qwen3"], kv_dtype_bytes=F32)
    assert dims is not None
    assert _measured(models, "qwen3") == dims.kv_bytes_per_token == 2 * 2 * 2 * 16 * F32
    # A window not yet reached grows like any KV.
    gemma = model_dims(ARCH_CONFIGS["gemma3_text"], kv_dtype_bytes=F32)
    assert gemma is not None and _measured(models, "gemma3_text") == gemma.kv_bytes_per_token


def test_a_hybrid_counts_only_its_attention_layers(models: Path) -> None:
    config = ARCH_CONFIGS["lfm2"]
    guessed = model_dims(config, kv_dtype_bytes=F32)
    assert guessed is not None
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    attention = len(config["full_attn_idxs"]) * 2 * config["num_key_value_heads"] * head_dim * F32
    assert _measured(models, "lfm2") == attention == guessed.kv_bytes_per_token // 2


def test_a_state_space_model_grows_no_kv(models: Path) -> None:
    """Its config names no attention heads (the guard's config dims fall back to a
    guess) and its cache holds fixed states only. The guard models memory per
    token, so it keeps the conservative figure for it (issue 41 notes what is left)."""
    config = ARCH_CONFIGS["mamba"]
    assert model_dims(config, kv_dtype_bytes=F32) is None
    assert guard_dims(config, kv_dtype_bytes=F32, model="mamba").kv_bytes_per_token > 0
    assert _measured(models, "mamba") == 0


def test_the_guard_of_a_loaded_hybrid_uses_the_measured_kv(make_pool, models: Path) -> None:
    pool = make_pool(models)

    async def main() -> None:
        engine = await pool.get_engine("lfm2")
        assert engine.guard.dims.kv_bytes_per_token == _measured(models, "lfm2")
        assert "B/token (measured)" in engine.guard.describe()

    asyncio.run(main())
