"""What /api/tags and /api/show tell about a model folder, read from its files."""

from __future__ import annotations

import json
from pathlib import Path

from omlx.api.ollama_models import read_facts, show_body, tags_entry
from omlx.cache.safetensors_io import encode
from omlx.models.discovery import ModelInfo
from omlx.settings import SamplingSettings


def write_model(folder: Path, config: dict, tensors: dict, template: str = "") -> ModelInfo:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    header, chunks = encode(tensors, {})
    (folder / "model.safetensors").write_bytes(header + b"".join(chunks))
    size = (folder / "model.safetensors").stat().st_size
    return ModelInfo(folder.name, folder, config["model_type"], "llm", size)


def test_a_quantized_model_counts_packed_parameters(tmp_path: Path) -> None:
    config = {"model_type": "qwen3", "quantization": {"bits": 4, "group_size": 64}}
    tensors = {
        "layer.weight": ("U32", (4, 2), bytes(32)),  # 4 x 16 four-bit weights
        "layer.scales": ("F16", (4, 1), bytes(8)),
        "layer.biases": ("F16", (4, 1), bytes(8)),
        "norm.weight": ("BF16", (8,), bytes(16)),
    }
    info = write_model(tmp_path / "q4", config, tensors, "{{ enable_thinking }}")
    facts = read_facts(info, "q4-alias")
    assert facts.parameter_count == 4 * 16 + 8
    details = tags_entry(facts)["details"]
    assert details["quantization_level"] == "Q4" and details["parameter_size"] == "72"
    assert tags_entry(facts)["name"] == "q4-alias:latest"
    shown = show_body(facts, SamplingSettings(temperature=0.6))
    assert shown["capabilities"] == ["completion", "tools", "thinking"]
    assert "temperature 0.6" in shown["parameters"].splitlines()
    assert shown["model_info"]["general.parameter_count"] == 72


def test_an_unquantized_model_names_its_dtype(tmp_path: Path) -> None:
    config = {"model_type": "llama", "hidden_size": 64, "max_position_embeddings": 2048}
    tensors = {"embed.weight": ("BF16", (1000, 1500), bytes(3_000_000))}
    facts = read_facts(write_model(tmp_path / "bf16", config, tensors), "bf16")
    details = tags_entry(facts)["details"]
    assert details["quantization_level"] == "BF16" and details["parameter_size"] == "1.5M"
    info = show_body(facts, SamplingSettings())["model_info"]
    assert info["llama.context_length"] == 2048 and info["llama.embedding_length"] == 64
    # No chat template: plain completion only.
    assert show_body(facts, SamplingSettings())["capabilities"] == ["completion"]
