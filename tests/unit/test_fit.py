"""The fit estimate: SmolLM2 worked out by hand, and configs as mlx-lm models ship them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omlx.errors import SettingsError
from omlx.memory.fit import estimate_fit, fit_for_settings
from omlx.settings import Settings

GB = 1000**3
MIB = 1024**2
RAM = 64 * GB  # a stand-in machine for settings given as sizes or "auto"

LLAMA_8B_4BIT = {  # mlx-community/Meta-Llama-3.1-8B-Instruct-4bit's config.json (abridged)
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "quantization": {"group_size": 64, "bits": 4},
}
LLAMA_8B_4BIT_WEIGHTS = 4_520_000_000


def _smollm2(folder: Path) -> tuple[dict, int]:
    config = json.loads((folder / "config.json").read_text())
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return config, weights


def test_smollm2_fits_under_24gb_with_every_request_at_full_context(smollm2_path: Path) -> None:
    """By hand, from the real folder: config.json says 30 layers, 3 KV heads of 64,
    context 8192 and no dtype, so KV is taken as float32 (the CPU import here is
    float32; this over-estimates a Mac's bf16 import 2x, never under-estimates).
    KV per token = 2 (K and V) x 30 x 3 x 64 x 4 B = 46,080 B. At the default 8
    concurrent requests x 8192 tokens the KV is 65,536 x 46,080 B = 3.02 GB; the
    guard counts it twice while its cache buffer grows (copy), plus the weights
    (~538 MB float32 for 135M parameters), the attention chunk (512 x 9 heads x 64
    x 4 B), the 64 MiB margin floor and the 2% canary capped at 256 MiB: ~6.9 GB,
    far below 24 GB."""
    config, weights = _smollm2(smollm2_path)
    assert 500_000_000 < weights < 600_000_000  # 135M float32 parameters
    kv_per_token = 2 * 30 * 3 * 64 * 4
    tokens = 8 * 8192
    settings = Settings(memory={"max_process_memory": "24GB"})

    fit = fit_for_settings(config, weights, settings, total_ram_bytes=RAM)

    by_hand = weights + 2 * kv_per_token * tokens + 512 * 9 * 64 * 4 + 64 * MIB + 256 * MIB
    assert fit.verdict == "fits" and fit.as_dict()["message"] == "fits"
    assert (fit.context_tokens, fit.concurrency, fit.limit_bytes) == (8192, 8, 24 * GB)
    assert fit.kv_bytes == kv_per_token * tokens == 3_019_898_880
    assert fit.weights_bytes == weights
    assert fit.total_bytes == by_hand
    assert fit.total_bytes == fit.weights_bytes + fit.kv_bytes + fit.transient_bytes
    assert any("float32" in note for note in fit.notes)


def test_smollm2_under_1gb_fits_only_a_shorter_context(smollm2_path: Path) -> None:
    """By hand: 1 GB less the weights (~538 MB), the attention chunk (1.2 MB), the
    64 MiB margin and the canary (2% of 1 GB = 20 MB) leaves ~374 MB for KV, which
    the guard counts twice (held + growth copy): 374 MB / (2 x 46,080 B) = 4,054
    tokens for all 8 requests, 506 each, rounded down to 448 (a multiple of 64).
    The full 8192-token context would need 6.7 GB."""
    config, weights = _smollm2(smollm2_path)
    kv_per_token = 2 * 30 * 3 * 64 * 4
    fixed = weights + 512 * 9 * 64 * 4 + 64 * MIB + GB * 2 // 100
    per_request = (GB - fixed) // (2 * kv_per_token) // 8
    assert 448 <= per_request < 512
    settings = Settings(memory={"max_process_memory": "1GB"})

    fit = fit_for_settings(config, weights, settings, total_ram_bytes=RAM)

    assert fit.verdict == "fits_shorter_context"
    assert fit.max_context_tokens == 448
    assert fit.as_dict()["message"] == "fits with a shorter context: 448 tokens"
    assert fit.total_bytes > 6 * GB  # the full context, as asked
    # One request at a time gets 8x the room: 4,054 tokens, in whole 256-token blocks.
    single = Settings(
        memory={"max_process_memory": "1GB"}, scheduler={"max_concurrent_requests": 1}
    )
    assert fit_for_settings(config, weights, single, total_ram_bytes=RAM).max_context_tokens == 3840


def test_weights_over_the_limit_do_not_fit_and_say_how_much() -> None:
    fit = estimate_fit(LLAMA_8B_4BIT, LLAMA_8B_4BIT_WEIGHTS, limit_bytes=4 * GB, concurrency=1)
    assert fit.verdict == "does_not_fit"
    assert fit.max_context_tokens is None
    message = fit.as_dict()["message"]
    assert message.startswith("does not fit: needs ") and message.endswith(", limit 4 GB")
    assert fit.total_bytes > fit.weights_bytes > fit.limit_bytes


def test_bf16_kv_from_torch_dtype_and_the_settings_window_caps_the_context() -> None:
    """Llama 3.1 8B: 2 x 32 x 8 x 128 x 2 B = 131,072 B per token; the server caps
    its 131,072-token context at generation.max_context_window."""
    settings = Settings(
        memory={"max_process_memory": "48GB"},
        scheduler={"max_concurrent_requests": 2},
        generation={"max_context_window": 8192},
    )
    fit = fit_for_settings(LLAMA_8B_4BIT, LLAMA_8B_4BIT_WEIGHTS, settings, total_ram_bytes=RAM)
    assert fit.context_tokens == 8192
    assert fit.kv_bytes == 131_072 * 8192 * 2
    assert fit.verdict == "fits"
    assert fit.notes == ()  # everything came from the config


def test_a_quantized_kv_cache_counts_its_quantized_bytes() -> None:
    """Llama 3.1 8B with kv_bits: per K or V vector of 128, 128 B (8 bits) or 64 B
    (4 bits) of values plus a bf16 scale and bias per group of 64 (8 B)."""
    full = estimate_fit(LLAMA_8B_4BIT, LLAMA_8B_4BIT_WEIGHTS, limit_bytes=12 * GB, concurrency=1)
    for bits, per_vector in ((8, 128 + 8), (4, 64 + 8)):
        fit = estimate_fit(
            LLAMA_8B_4BIT,
            LLAMA_8B_4BIT_WEIGHTS,
            limit_bytes=12 * GB,
            concurrency=1,
            kv_quant=(bits, 64),
        )
        assert fit.kv_bytes == 2 * 32 * 8 * per_vector * fit.context_tokens
        assert fit.kv_bytes <= (0.55 if bits == 8 else 0.3) * full.kv_bytes
        assert fit.max_context_tokens is not None and full.max_context_tokens is not None
        assert fit.max_context_tokens > 1.8 * full.max_context_tokens
        assert "kv_bits" in " ".join(fit.notes)


def test_text_config_nesting_is_read_like_a_flat_config() -> None:
    flat = estimate_fit(LLAMA_8B_4BIT, LLAMA_8B_4BIT_WEIGHTS, limit_bytes=24 * GB, concurrency=4)
    vlm = {
        "model_type": "llava",
        "vision_config": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16},
        "text_config": LLAMA_8B_4BIT,
    }
    nested = estimate_fit(vlm, LLAMA_8B_4BIT_WEIGHTS, limit_bytes=24 * GB, concurrency=4)
    assert nested.as_dict() == flat.as_dict()


def test_a_config_missing_fields_is_estimated_conservatively_and_says_so() -> None:
    sparse = {"model_type": "mystery", "num_hidden_layers": 32}
    fit = estimate_fit(sparse, LLAMA_8B_4BIT_WEIGHTS, limit_bytes=24 * GB, concurrency=1)
    full = estimate_fit(LLAMA_8B_4BIT, LLAMA_8B_4BIT_WEIGHTS, limit_bytes=24 * GB, concurrency=1)
    assert fit.context_tokens == 32768
    assert fit.kv_bytes / fit.context_tokens > full.kv_bytes / full.context_tokens
    joined = " ".join(fit.notes)
    assert "no dtype" in joined and "layer or head counts" in joined and "context length" in joined


def test_baseline_and_concurrency_shrink_the_room() -> None:
    alone = estimate_fit(
        LLAMA_8B_4BIT,
        LLAMA_8B_4BIT_WEIGHTS,
        limit_bytes=16 * GB,
        concurrency=1,
        context_tokens=16384,
    )
    crowded = estimate_fit(
        LLAMA_8B_4BIT,
        LLAMA_8B_4BIT_WEIGHTS,
        limit_bytes=16 * GB,
        concurrency=1,
        context_tokens=16384,
        baseline_bytes=8 * GB,
    )
    assert alone.verdict == "fits"
    assert crowded.verdict == "fits_shorter_context"
    assert crowded.total_bytes == alone.total_bytes + 8 * GB
    assert crowded.max_context_tokens is not None and crowded.max_context_tokens % 256 == 0


def test_a_pinned_margin_is_counted_in_full() -> None:
    auto = fit_for_settings(LLAMA_8B_4BIT, LLAMA_8B_4BIT_WEIGHTS, Settings(), total_ram_bytes=RAM)
    pinned = fit_for_settings(
        LLAMA_8B_4BIT,
        LLAMA_8B_4BIT_WEIGHTS,
        Settings(memory={"prefill_transient_margin": "4GB"}),
        total_ram_bytes=RAM,
    )
    assert pinned.transient_bytes - auto.transient_bytes == 4 * GB - 64 * MIB


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"limit_bytes": 0, "concurrency": 1}, "limit_bytes"),
        ({"limit_bytes": GB, "concurrency": 0}, "concurrency"),
        ({"limit_bytes": GB, "concurrency": 1, "context_tokens": 0}, "context_tokens"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        estimate_fit(LLAMA_8B_4BIT, 1, **kwargs)


def test_a_limit_above_ram_is_a_settings_error_naming_the_field() -> None:
    settings = Settings(memory={"max_process_memory": "128GB"})
    with pytest.raises(SettingsError, match="max_process_memory"):
        fit_for_settings(LLAMA_8B_4BIT, LLAMA_8B_4BIT_WEIGHTS, settings, total_ram_bytes=RAM)
