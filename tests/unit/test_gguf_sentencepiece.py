"""SentencePiece (llama-style) GGUF tokenizers, from a SentencePiece model trained here.

The ``sentencepiece`` package (from PyPI) trains a tiny BPE model with byte
fallback and identity normalization, as Llama 2's tokenizer.model is; it is
written into the GGUF the way llama.cpp's converter writes one (pieces,
scores, token types). The imported tokenizer must cut plain text exactly as
SentencePiece itself does, and treat special tokens as llama.cpp does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx.errors import ImportFailedError
from omlx.models.gguf import convert_gguf
from tests.fixtures.gguf_files import train_sentencepiece, write_model_gguf
from tests.fixtures.tiny_models import build_tiny_model

gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")
Q = gguf.GGMLQuantizationType

TEXTS = [
    "Hello world 12345, then 3.14!",
    "naïve café — Straße, 東京 and 🚀 (bytes the vocabulary lacks)",
    "  leading spaces\n\nnew lines\tand tabs  ",
    "The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def imported(sp_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sp-model")
    size = spm.SentencePieceProcessor(model_file=str(sp_model)).get_piece_size()
    source = build_tiny_model(root / "src", "gguf-llama", vocab_size=size)
    write_model_gguf(source, root / "sp.gguf", Q.Q4_K, sentencepiece=sp_model)
    return convert_gguf(root / "sp.gguf", root / "model").path


def test_plain_text_is_cut_as_sentencepiece_cuts_it(sp_model: Path, imported: Path) -> None:
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    tok = AutoTokenizer.from_pretrained(str(imported))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [sp.bos_id(), *sp.encode(text)], text  # add_bos, as the file says
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert any(sp.is_byte(i) for i in sp.encode(TEXTS[1]))  # byte fallback was exercised


def test_special_tokens_follow_llama_cpp(sp_model: Path, imported: Path) -> None:
    from mlx_lm import load

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    _, tok = load(str(imported))
    start, end = sp.piece_to_id("<|im_start|>"), sp.piece_to_id("<|im_end|>")
    # llama.cpp matches special tokens whole and gives the text after one a space prefix.
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids == [sp.bos_id(), start, *sp.encode("user\nhi"), end]
    assert end in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_a_sentencepiece_vocabulary_without_scores_is_refused(tmp_path: Path, sp_model) -> None:
    from omlx.models.gguf_tokenizer import build_tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces}
    with pytest.raises(ImportFailedError, match=r"tokenizer\.ggml\.scores must give one score"):
        build_tokenizer(metadata, model_max_length=256)


def test_no_space_prefix_when_the_file_says_so(sp_model: Path) -> None:
    import numpy as np

    from omlx.models.gguf_tokenizer import build_tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    size = sp.get_piece_size()
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(size)],
        "tokenizer.ggml.scores": np.array([sp.get_score(i) for i in range(size)], np.float32),
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": False,
    }
    tokenizer = build_tokenizer(metadata, model_max_length=256).tokenizer
    ids = tokenizer.encode("hello world").ids
    assert not sp.id_to_piece(ids[0]).startswith("\u2581")  # no prefix on the first word
    assert tokenizer.decode(ids) == "hello world"
