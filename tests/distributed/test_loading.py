"""Which split a model gets, on the real mlx-lm classes (loaded lazily: no weights read)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load_model

from omlx.distributed.loading import choose_mode
from omlx.errors import ModelLoadError


def test_builtin_smollm2_splits_by_layers_across_two_ranks(smollm2_path: Path) -> None:
    """SmolLM2-135M has 9 attention heads (3 KV heads): 2 ranks cannot share them, so
    it splits by layers (omlx's llama pipeline: mlx-lm's llama class has none); 3 ranks
    share the heads (tensor parallel)."""
    model, config = load_model(smollm2_path, lazy=True, strict=False)
    assert choose_mode(model, config, 2, "auto", "SmolLM2") == "pipeline"
    with pytest.raises(ModelLoadError) as info:
        choose_mode(model, config, 2, "tensor", "SmolLM2")
    assert info.value.message == (
        "cannot split model 'SmolLM2' across 2 ranks: tensor parallel: num_attention_heads "
        "= 9 is not a multiple of the 2 ranks"
    )
    assert choose_mode(model, config, 3, "auto", "SmolLM2") == "tensor"


def test_a_model_that_splits_neither_way_says_why(tmp_path: Path) -> None:
    from tests.fixtures.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "q3", "qwen3", num_attention_heads=3, num_key_value_heads=3)
    model, config = load_model(path, lazy=True, strict=False)
    with pytest.raises(ModelLoadError) as info:
        choose_mode(model, config, 2, "auto", "q3")
    assert info.value.message == (
        "cannot split model 'q3' across 2 ranks: tensor parallel: num_attention_heads = 3 "
        "is not a multiple of the 2 ranks; pipeline parallel: its mlx-lm model class has "
        "no `pipeline`"
    )


def test_a_model_with_both_splits_takes_the_one_asked(split_models_dir: Path) -> None:
    model, config = load_model(split_models_dir / "tiny-qwen2", lazy=True, strict=False)
    assert choose_mode(model, config, 2, "auto", "q") == "tensor"
    assert choose_mode(model, config, 2, "pipeline", "q") == "pipeline"
    with pytest.raises(ModelLoadError, match="it has 2 layers, fewer than the 4 ranks"):
        choose_mode(model, config, 4, "pipeline", "q")


def test_a_rank_without_the_model_says_where_to_copy_it(tmp_path: Path) -> None:
    """A follower rank asked to load a model its host lacks answers with the folder to
    copy it into (it raised a TypeError: the 404 class it used takes other arguments)."""
    from omlx.distributed.group import Membership
    from omlx.distributed.serve import _follower_runner
    from omlx.errors import NotFoundError
    from omlx.settings import load_settings

    settings = load_settings(
        {"base_path": str(tmp_path), "models": {"model_dirs": [str(tmp_path)]}}
    )
    member = Membership(group=None, rank=1, size=2, backend="ring")
    with pytest.raises(NotFoundError) as info:
        _follower_runner(settings, member, "auto", "not-here", None, None)
    assert info.value.message == (
        f"rank 1 has no model 'not-here' in {tmp_path}: copy it there on this host"
    )
