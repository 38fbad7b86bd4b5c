"""Which code a model folder names for its loaders (omlx/models/remote_code.py), read
from real files as checkpoints ship them, and transformers' and mlx-lm's own refusals
mapped to omlx's error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omlx.errors import RemoteCodeNotAllowedError
from omlx.models.remote_code import folder_code, library_refusal, require_allowed
from tests.fixtures.tiny_models import build_tiny_model


def write(folder: Path, files: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_text(data if isinstance(data, str) else json.dumps(data))
    return folder


def described(folder: Path) -> list[str]:
    return [code.describe() for code in folder_code(folder)]


def test_a_plain_folder_names_no_code(tmp_path: Path) -> None:
    folder = write(
        tmp_path / "m", {"config.json": {"model_type": "llama"}, "tokenizer_config.json": {}}
    )
    assert folder_code(folder) == []
    require_allowed("m", folder, False)  # no error


def test_modeling_code_in_config_json_is_not_loaded_code(tmp_path: Path) -> None:
    # DeepSeek-V3's convention: config.json names its configuration and modeling
    # modules, which mlx-lm never imports (it has its own model class).
    folder = write(
        tmp_path / "DeepSeek-V3",
        {
            "config.json": {
                "model_type": "deepseek_v3",
                "auto_map": {
                    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
                    "AutoModel": "modeling_deepseek.DeepseekV3Model",
                    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
                },
            },
            "tokenizer_config.json": {"tokenizer_class": "LlamaTokenizerFast"},
        },
    )
    assert folder_code(folder) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # Kimi's tokenizer: the legacy list form
            {"tokenizer_config.json": {"auto_map": ["tokenization_kimi.TikTokenTokenizer", None]}},
            "tokenization_kimi.py, named by auto_map in tokenizer_config.json",
        ),
        (
            {
                "tokenizer_config.json": {
                    "auto_map": {
                        "AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XFast"]
                    }
                }
            },
            "tokenization_x.py, named by auto_map in tokenizer_config.json",
        ),
        (  # Molmo's processor and image processor
            {
                "preprocessor_config.json": {
                    "auto_map": {
                        "AutoProcessor": "preprocessing_molmo.MolmoProcessor",
                        "AutoImageProcessor": "image_preprocessing_molmo.MolmoImageProcessor",
                    }
                }
            },
            "preprocessing_molmo.py, image_preprocessing_molmo.py, named by auto_map in "
            "preprocessor_config.json",
        ),
        (  # code in another Hub repository
            {"tokenizer_config.json": {"auto_map": {"AutoTokenizer": ["org/repo--tok.T", None]}}},
            "org/repo: tok.py, named by auto_map in tokenizer_config.json",
        ),
        (
            {"config.json": {"model_type": "custom", "model_file": "my_model.py"}},
            "my_model.py, named by model_file in config.json",
        ),
    ],
)
def test_code_the_loaders_would_import_is_named(
    tmp_path: Path, files: dict[str, Any], expected: str
) -> None:
    folder = write(tmp_path / "m", files)
    assert described(folder) == [expected]
    with pytest.raises(RemoteCodeNotAllowedError) as refused:
        require_allowed("m", folder, False)
    assert refused.value.http_status == 403
    assert refused.value.param == "trust_remote_code"
    assert refused.value.message == (
        f"model 'm' ships its own Python code ({expected}); omlx runs a model folder's "
        "code only when you allow it: set trust_remote_code: true in its settings"
    )
    require_allowed("m", folder, True)  # allowed: no error


def test_unreadable_files_name_no_code(tmp_path: Path) -> None:
    folder = write(tmp_path / "m", {"tokenizer_config.json": "{not json", "config.json": "[]"})
    assert folder_code(folder) == []


def test_transformers_own_refusal_maps_to_the_clear_error(tmp_path: Path) -> None:
    """A tokenizer transformers has no class of its own for: with
    trust_remote_code=False it raises a ValueError, which becomes omlx's error."""
    from transformers import AutoTokenizer

    folder = write(
        tmp_path / "odd",
        {
            "config.json": {"model_type": "not_a_transformers_type"},
            "tokenizer_config.json": {
                "tokenizer_class": "OddTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_odd.OddTokenizer", None]},
            },
            "tokenization_odd.py": "raise SystemExit('must not run')\n",
        },
    )
    with pytest.raises(ValueError) as raised:
        AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    mapped = library_refusal("odd", raised.value)
    assert mapped is not None and mapped.http_status == 403
    assert mapped.message.startswith("model 'odd' needs its own Python code to load (")
    assert mapped.message.endswith("set trust_remote_code: true in its settings")
    assert library_refusal("odd", ValueError("bad weights")) is None
    assert library_refusal("odd", OSError("trust_remote_code")) is None


def test_mlx_lm_model_file_refusal_maps_to_the_clear_error(tmp_path: Path) -> None:
    from mlx_lm.utils import load_model

    folder = build_tiny_model(tmp_path / "tiny", "llama", seed=0, num_hidden_layers=1)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_file": "arch.py"}))
    with pytest.raises(ValueError) as raised:
        load_model(folder)
    mapped = library_refusal("tiny", raised.value)
    assert mapped is not None and "set trust_remote_code: true" in mapped.message
