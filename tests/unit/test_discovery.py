"""Finding model folders under the model dirs and telling their kind."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from omlx.models.discovery import detect_kind, discover_models

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def make_model(folder: Path, config: dict | None = None, weights_bytes: int = 16) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or LLAMA), encoding="utf-8")
    if weights_bytes:
        (folder / "model.safetensors").write_bytes(b"\0" * weights_bytes)
    return folder


def test_one_level_folder(tmp_path):
    folder = make_model(tmp_path / "tiny-llama", weights_bytes=40)

    models = discover_models([tmp_path])

    assert list(models) == ["tiny-llama"]
    info = models["tiny-llama"]
    assert (info.name, info.path, info.model_type, info.kind, info.size_bytes) == (
        "tiny-llama",
        folder,
        "llama",
        "llm",
        40,
    )


def test_two_level_org_name_folders(tmp_path):
    make_model(tmp_path / "mlx-community" / "Qwen3-0.6B")
    make_model(tmp_path / "mlx-community" / "SmolLM2")
    make_model(tmp_path / "local")

    assert sorted(discover_models([tmp_path])) == [
        "local",
        "mlx-community/Qwen3-0.6B",
        "mlx-community/SmolLM2",
    ]


def test_size_counts_every_safetensors_shard(tmp_path):
    folder = make_model(tmp_path / "sharded", weights_bytes=10)
    (folder / "model-00002.safetensors").write_bytes(b"\0" * 5)
    (folder / "tokenizer.json").write_bytes(b"\0" * 1000)

    assert discover_models([tmp_path])["sharded"].size_bytes == 15


def test_hidden_folders_are_skipped_at_both_levels(tmp_path):
    make_model(tmp_path / ".importing-model")
    make_model(tmp_path / "org" / ".tmp-name")
    make_model(tmp_path / ".hidden-org" / "name")
    make_model(tmp_path / "org" / "visible")

    assert list(discover_models([tmp_path])) == ["org/visible"]


def test_folder_without_weights_is_skipped(tmp_path):
    make_model(tmp_path / "no-weights", weights_bytes=0)
    make_model(tmp_path / "empty-weights", weights_bytes=0)
    (tmp_path / "empty-weights" / "model.safetensors").write_bytes(b"")
    (tmp_path / "gguf-only").mkdir()
    (tmp_path / "gguf-only" / "model.gguf").write_bytes(b"GGUF")

    assert discover_models([tmp_path]) == {}


def test_folder_with_weights_but_no_config_is_skipped(tmp_path):
    (tmp_path / "weights-only").mkdir()
    (tmp_path / "weights-only" / "model.safetensors").write_bytes(b"\0" * 8)

    assert discover_models([tmp_path]) == {}


@pytest.mark.parametrize("text", ["{not json", "[1, 2, 3]", ""])
def test_unreadable_config_is_skipped_and_others_still_found(tmp_path, caplog, text):
    broken = make_model(tmp_path / "broken")
    (broken / "config.json").write_text(text, encoding="utf-8")
    make_model(tmp_path / "good")

    with caplog.at_level(logging.WARNING, logger="omlx.models.discovery"):
        models = discover_models([tmp_path])

    assert list(models) == ["good"]


def test_invalid_config_json_is_logged_with_the_folder(tmp_path, caplog):
    broken = make_model(tmp_path / "broken")
    (broken / "config.json").write_text("{not json", encoding="utf-8")

    with caplog.at_level(logging.WARNING, logger="omlx.models.discovery"):
        discover_models([tmp_path])

    assert any(str(broken) in r.getMessage() for r in caplog.records)


def test_missing_model_dir_is_not_an_error(tmp_path):
    make_model(tmp_path / "real" / "m")

    assert list(discover_models([tmp_path / "absent", tmp_path / "real"])) == ["m"]


def test_first_model_dir_wins_on_name_clash(tmp_path):
    first = make_model(tmp_path / "a" / "same-name", weights_bytes=1)
    make_model(tmp_path / "b" / "same-name", weights_bytes=2)
    make_model(tmp_path / "b" / "only-in-b")

    models = discover_models([tmp_path / "a", tmp_path / "b"])

    assert models["same-name"].path == first
    assert sorted(models) == ["only-in-b", "same-name"]


def test_broken_model_in_first_dir_does_not_hide_the_second(tmp_path):
    make_model(tmp_path / "a" / "m", weights_bytes=0)
    second = make_model(tmp_path / "b" / "m")

    assert discover_models([tmp_path / "a", tmp_path / "b"])["m"].path == second


def test_kinds_are_detected_from_config(tmp_path):
    make_model(tmp_path / "chat", LLAMA)
    make_model(
        tmp_path / "vision",
        {"model_type": "qwen2_5_vl", "architectures": ["X"], "vision_config": {"depth": 2}},
    )
    make_model(tmp_path / "embed", {"model_type": "bert", "architectures": ["BertModel"]})
    make_model(tmp_path / "notype", {"architectures": ["LlamaForCausalLM"]})
    qwen3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    make_model(tmp_path / "Qwen3-Reranker-0.6B-4bit", qwen3)
    # Named a reranker but not a causal LM (a ranking head of its own): not ours to score.
    make_model(tmp_path / "other-reranker", {"architectures": ["JinaForRanking"]})
    # A sentence-transformers folder named like a reranker still embeds.
    make_model(tmp_path / "st-reranker", qwen3)
    (tmp_path / "st-reranker" / "modules.json").write_text("[]")

    models = discover_models([tmp_path])

    assert {name: info.kind for name, info in models.items()} == {
        "chat": "llm",
        "vision": "vlm",
        "embed": "embedding",
        "notype": "llm",
        "Qwen3-Reranker-0.6B-4bit": "rerank",
        "other-reranker": "llm",
        "st-reranker": "embedding",
    }
    assert models["notype"].model_type == "unknown"


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        ({}, "llm"),
        ({"architectures": None}, "llm"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "llm"),
        ({"vision_config": {}}, "vlm"),
        # Where Molmo2, Qwen3-Omni and Molmo ship theirs (Molmo, Phi-3.5-vision, Phi-4-mm: nowhere).
        ({"architectures": ["Molmo2ForConditionalGeneration"], "vit_config": {}}, "vlm"),
        ({"thinker_config": {"vision_config": {}}}, "vlm"),
        ({"architectures": ["MolmoForCausalLM"], "model_type": "molmo"}, "vlm"),
        # Phi-3.5-vision's and Phi-4-multimodal's configs as their checkpoints ship them.
        ({"architectures": ["Phi3VForCausalLM"], "model_type": "phi3_v"}, "vlm"),
        ({"architectures": ["Phi4MMForCausalLM"], "model_type": "phi4mm"}, "vlm"),
        # A VLM told by its architecture alone; a text seq2seq head is not one.
        ({"architectures": ["LlavaForConditionalGeneration"]}, "vlm"),
        ({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}, "vlm"),
        ({"architectures": ["Qwen2VLForConditionalGeneration"]}, "vlm"),
        ({"architectures": ["T5ForConditionalGeneration"]}, "llm"),
        ({"architectures": ["XLMRobertaModel"]}, "embedding"),
        ({"architectures": ["NomicBertModel"]}, "embedding"),
        ({"architectures": ["ModernBertForMaskedLM"]}, "embedding"),
        # An embedding architecture wins over a vision tower.
        ({"architectures": ["BertModel"], "vision_config": {}}, "embedding"),
    ],
)
def test_detect_kind(config, kind):
    assert detect_kind(config) == kind


def test_dangling_weights_symlink_skips_only_that_folder(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    (broken / "model.safetensors").symlink_to(tmp_path / "deleted-blob")
    make_model(tmp_path / "good")

    assert list(discover_models([tmp_path])) == ["good"]
