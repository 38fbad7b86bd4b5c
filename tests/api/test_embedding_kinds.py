"""More embedding folders, served live: a Matryoshka-declared BERT (``dimensions``),
a BERT cross-encoder (/v1/rerank scores pairs) and a decoder embedder (last-token
pooling over mlx-lm's Qwen3), each checked against a reference computed here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.fixtures.bert_reference import ReferenceBert
from tests.fixtures.modernbert_reference import ReferenceModernBert
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_encoders import (
    build_tiny_bert,
    build_tiny_cross_encoder,
    build_tiny_decoder_embedder,
    build_tiny_modernbert,
)

TEXTS = ["a short one", "a somewhat longer sentence about cats and dogs", "x"]


@pytest.fixture(scope="module")
def models_dir(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("embedding-kinds")
    build_tiny_bert(root / "tiny-mrl", minilm_path, seed=3, matryoshka_dims=[8, 16])
    build_tiny_bert(root / "tiny-cls", minilm_path, seed=4, pooling="cls_token")
    build_tiny_bert(root / "tiny-vocab-txt", minilm_path, seed=3, vocab_only=True)
    build_tiny_cross_encoder(root / "tiny-cross", minilm_path, seed=5)
    build_tiny_cross_encoder(root / "tiny-xlmr-cross", minilm_path, seed=7, roberta=True)
    build_tiny_decoder_embedder(root / "tiny-qwen3-embed", seed=6)
    build_tiny_modernbert(root / "tiny-modernbert", minilm_path, seed=8)
    # Weights whose names do not fit the encoder: a load error naming the mismatch.
    broken = build_tiny_bert(root / "broken-bert", minilm_path, seed=9)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    return root


@pytest.fixture(scope="module")
def server_url(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory.mktemp("base"), models_dir) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0)


def vectors(client: openai.OpenAI, model: str, inputs: list[str], **kw: object) -> np.ndarray:
    reply = client.embeddings.create(model=model, input=inputs, **kw)
    return np.array([d.embedding for d in reply.data])


def test_kinds_are_discovered(server_url: str) -> None:
    models = httpx.get(server_url + "/v1/models").json()["data"]
    kinds = {m["id"]: m["kind"] for m in models}
    assert kinds == {
        "tiny-mrl": "embedding",
        "tiny-cls": "embedding",
        "tiny-vocab-txt": "embedding",
        "tiny-cross": "rerank",
        "tiny-xlmr-cross": "rerank",
        "tiny-qwen3-embed": "embedding",
        "tiny-modernbert": "embedding",
        "broken-bert": "embedding",
    }


def test_mean_and_cls_pooling_match_the_numpy_reference(
    client: openai.OpenAI, models_dir: Path
) -> None:
    for name in ("tiny-mrl", "tiny-cls"):
        ref = ReferenceBert(models_dir / name)
        expected = np.stack([ref.embed(t) for t in TEXTS])
        np.testing.assert_allclose(vectors(client, name, TEXTS), expected, atol=1e-4)


def test_modernbert_matches_the_numpy_reference(client: openai.OpenAI, models_dir: Path) -> None:
    ref = ReferenceModernBert(models_dir / "tiny-modernbert")
    # The long text spans more than the 8-token sliding window of layers 1 and 2.
    texts = [*TEXTS, "one two three four five six seven eight nine ten eleven twelve"]
    expected = np.stack([ref.embed(t) for t in texts])
    np.testing.assert_allclose(vectors(client, "tiny-modernbert", texts), expected, atol=1e-4)


def test_a_folder_with_only_vocab_txt_embeds_like_its_tokenizer_json_twin(
    client: openai.OpenAI,
) -> None:
    # Same weights (seed 3) as tiny-mrl; its tokenizer is rebuilt from vocab.txt.
    twin = vectors(client, "tiny-mrl", TEXTS)
    np.testing.assert_allclose(vectors(client, "tiny-vocab-txt", TEXTS), twin, atol=1e-6)


def test_dimensions_truncates_a_matryoshka_model_and_renormalises(client: openai.OpenAI) -> None:
    full = vectors(client, "tiny-mrl", TEXTS)
    cut = vectors(client, "tiny-mrl", TEXTS, dimensions=16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="tiny-mrl", input="hi", dimensions=64)


@pytest.mark.parametrize("model", ["tiny-cross", "tiny-xlmr-cross"])
def test_cross_encoder_reranks_by_its_pair_scores(
    server_url: str, models_dir: Path, model: str
) -> None:
    ref = ReferenceBert(models_dir / model)
    query, docs = "where do cats sleep", TEXTS
    reply = httpx.post(
        server_url + "/v1/rerank", json={"model": model, "query": query, "documents": docs}
    ).json()
    assert reply["meta"]["method"] == "cross-encoder"
    expected = [ref.score(query, d) for d in docs]
    assert [r["index"] for r in reply["results"]] == list(np.argsort(expected)[::-1])
    for r in reply["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
    bad = httpx.post(server_url + "/v1/embeddings", json={"model": model, "input": "x"})
    assert bad.status_code == 400 and "rerank model" in bad.json()["error"]["message"]


def test_decoder_embedder_pools_the_last_token(client: openai.OpenAI, models_dir: Path) -> None:
    import mlx.core as mx
    from mlx_lm import load

    folder = models_dir / "tiny-qwen3-embed"
    model, tokenizer = load(str(folder))
    expected = []
    for text in TEXTS:  # one at a time: no padding at all
        hidden = model.model(mx.array([tokenizer.encode(text)]))[0, -1]
        expected.append(np.array(hidden / mx.linalg.norm(hidden)))
    # Served as one batch (right-padded), the vectors are the same.
    np.testing.assert_allclose(vectors(client, "tiny-qwen3-embed", TEXTS), expected, atol=1e-4)


def test_a_folder_that_cannot_load_says_why_and_others_still_serve(server_url: str) -> None:
    url = server_url + "/v1/embeddings"
    for _ in range(2):  # nothing half-loaded stays behind
        reply = httpx.post(url, json={"model": "broken-bert", "input": "x"}, timeout=60)
        assert reply.status_code == 500
        error = reply.json()["error"]
        assert error["code"] == "model_load_failed" and "broken-bert" in error["message"]
        assert "encoder.layer.2" in error["message"]  # the weights the config does not expect
    ok = httpx.post(url, json={"model": "tiny-cls", "input": "x"}, timeout=60)
    assert ok.status_code == 200
