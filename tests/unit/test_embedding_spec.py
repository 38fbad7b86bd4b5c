"""What a folder says about its embeddings, how inputs become sequences (pure code)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omlx.embeddings.engine import bucket_of
from omlx.embeddings.inputs import Sequence, _fit, token_sequences
from omlx.embeddings.spec import embedding_spec
from omlx.errors import InvalidRequestError
from omlx.models.discovery import detect_kind


def _write(folder: Path, name: str, data: object) -> None:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data))


def test_sentence_transformers_pooling_and_normalize(tmp_path: Path) -> None:
    _write(
        tmp_path, "modules.json", [{"type": "sentence_transformers.models.Pooling", "path": "p"}]
    )
    _write(
        tmp_path, "p/config.json", {"pooling_mode_cls_token": True, "word_embedding_dimension": 8}
    )
    spec = embedding_spec(tmp_path, {"model_type": "bert", "max_position_embeddings": 64})
    assert (spec.pooling, spec.normalize, spec.dimension, spec.max_tokens) == ("cls", False, 8, 64)
    assert spec.family == "encoder" and spec.truncate_dims == ()


def test_bare_and_decoder_folders_get_the_defaults(tmp_path: Path) -> None:
    bare = embedding_spec(tmp_path, {"model_type": "bert", "hidden_size": 16})
    assert (bare.pooling, bare.normalize, bare.dimension, bare.max_tokens) == (
        "mean",
        True,
        16,
        512,
    )
    decoder = embedding_spec(tmp_path, {"model_type": "qwen3", "hidden_size": 16})
    assert decoder.family == "decoder" and decoder.pooling == "lasttoken"
    # RoBERTa's positions start after the padding index: 514 rows hold 512 tokens.
    xlmr = embedding_spec(tmp_path, {"model_type": "xlm-roberta", "max_position_embeddings": 514})
    assert xlmr.max_tokens == 512


def test_matryoshka_dims_come_from_the_folder(tmp_path: Path) -> None:
    _write(tmp_path, "config_sentence_transformers.json", {"matryoshka_dims": [256, 64, "x"]})
    assert embedding_spec(tmp_path, {"model_type": "bert"}).truncate_dims == (64, 256)


@pytest.mark.parametrize(
    ("archs", "marker", "kind"),
    [
        (["BertModel"], None, "embedding"),
        (["RobertaModel"], None, "embedding"),
        (["BertForSequenceClassification"], None, "rerank"),
        (["Qwen3ForCausalLM"], "modules.json", "embedding"),
        (["Qwen3ForCausalLM"], "1_Pooling/config.json", "embedding"),
        (["Qwen3ForCausalLM"], None, "llm"),
    ],
)
def test_discovery_tells_embedders_by_config_and_folder(
    tmp_path: Path, archs: list[str], marker: str | None, kind: str
) -> None:
    if marker:
        _write(tmp_path, marker, {})
    assert detect_kind({"architectures": archs}, tmp_path) == kind


def test_truncation_keeps_the_closing_special_token() -> None:
    cut = _fit([101, 5, 6, 7, 102], [0] * 5, [1, 0, 0, 0, 1], 4)
    assert cut == Sequence([101, 5, 6, 102], [0, 0, 0, 0])
    assert _fit([5, 6, 7], [0] * 3, [0, 0, 0], 2).ids == [5, 6]


def test_token_inputs_are_checked_against_the_vocabulary_and_length() -> None:
    with pytest.raises(InvalidRequestError, match=r"input\[1\].*vocabulary"):
        token_sequences([[1], [99]], 8, 50, truncate=False, field="input")
    with pytest.raises(InvalidRequestError, match=r"input\[0\] is 9 tokens.*at most 8"):
        token_sequences([[1] * 9], 8, 50, truncate=False, field="input")
    assert token_sequences([[1] * 9], 8, 50, truncate=True, field="input")[0].ids == [1] * 8


def test_length_buckets_are_powers_of_two_from_16() -> None:
    assert [bucket_of(n) for n in (1, 16, 17, 100, 512)] == [16, 16, 32, 128, 512]
