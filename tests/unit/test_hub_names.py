"""Pure parts of Hub downloads: names, progress counting, labels, speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omlx.errors import InvalidRequestError
from omlx.models.downloads import RateMeter, check_name, claim_partial, partial_bytes
from omlx.models.hub import mlx_lm_supports, quantization_label
from omlx.settings import Settings


@pytest.mark.parametrize("name", ["", " ", "a/b", "..", ".x", "a\\b", " x", "x\n", "x" * 201])
def test_unsafe_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        check_name(name)
    assert refused.value.param == "name"


def test_safe_names_pass() -> None:
    assert check_name("Qwen3-0.6B-4bit") == "Qwen3-0.6B-4bit"


def test_partial_bytes_counts_files_and_temp_files_not_metadata(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(b"x" * 10)
    cache = tmp_path / ".cache" / "huggingface" / "download"
    cache.mkdir(parents=True)
    (cache / "config.json.metadata").write_bytes(b"m" * 100)
    (cache / "abc.def.incomplete").write_bytes(b"y" * 7)
    assert partial_bytes(tmp_path) == 17


def test_a_partial_of_another_repo_is_cleared(tmp_path: Path) -> None:
    partial = tmp_path / ".m.download-partial"
    claim_partial(partial, "a/one")
    (partial / "model.safetensors").write_bytes(b"1")
    claim_partial(partial, "a/one")
    assert (partial / "model.safetensors").exists()
    claim_partial(partial, "b/two")
    assert not (partial / "model.safetensors").exists()
    marker = partial / ".cache/omlx-download.json"
    assert json.loads(marker.read_text()) == {"repo_id": "b/two", "gguf_file": None}
    # Another GGUF of the same repo is another download: its file must not mix in.
    claim_partial(partial, "b/two", "x.Q4_K_M.gguf")
    (partial / "x.Q4_K_M.gguf").write_bytes(b"GGUF")
    claim_partial(partial, "b/two", "x.Q4_K_M.gguf")
    assert (partial / "x.Q4_K_M.gguf").exists()
    claim_partial(partial, "b/two", "x.Q8_0.gguf")
    assert not (partial / "x.Q4_K_M.gguf").exists()
    assert json.loads(marker.read_text()) == {"repo_id": "b/two", "gguf_file": "x.Q8_0.gguf"}


def test_rate_meter_measures_the_recent_window() -> None:
    meter = RateMeter(window_s=5.0)
    assert meter.add(0.0, 0) == 0.0
    assert meter.add(1.0, 1000) == 1000.0
    for t in range(2, 20):
        speed = meter.add(float(t), 1000 + (t - 1) * 10)
    assert speed == pytest.approx(10.0)  # the early burst left the window


def test_quantization_label() -> None:
    assert quantization_label({"quantization": {"bits": 3, "group_size": 64}}, []) == "3bit"
    assert quantization_label(None, ["mlx-community/Qwen3-8B-4bit"]) == "4bit"
    assert quantization_label(None, ["org/x", "8-bit"]) == "8bit"
    assert quantization_label(None, ["org/Llama-3.2-1B-Instruct-bf16"]) is None


def test_mlx_lm_model_types() -> None:
    assert mlx_lm_supports("llama") and mlx_lm_supports("qwen3")
    assert mlx_lm_supports("mistral")  # remapped to llama by mlx-lm
    assert not mlx_lm_supports("not_a_real_arch")


def test_hf_settings() -> None:
    settings = Settings(models={"hf_endpoint": "https://hf-mirror.com/", "hf_token": "hf_x"})
    assert settings.models.hf_endpoint == "https://hf-mirror.com"
    assert "hf_x" not in repr(settings) and "hf_x" not in str(settings.models)
    with pytest.raises(ValueError, match="hf_endpoint"):
        Settings(models={"hf_endpoint": "mirror.example"})
