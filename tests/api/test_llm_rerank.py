"""LLM rerankers (Qwen3-Reranker style) served live: a tiny random Qwen3 whose folder
name says reranker scores each document by softmax([no, yes]) at the last position of
the model card's prompt; checked against the same model's full logits computed here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from omlx.models.model_settings import ModelSettingsStore
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_encoders import build_tiny_llm_reranker

# Qwen3-Reranker's model card, written out here (not imported from omlx).
SYSTEM = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
CLOSE = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
TASK = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "where do cats sleep"
DOCS = [
    "cats sleep on the warm windowsill most afternoons",
    "the stock market closed higher",
    "a dog and a cat share the sofa at night",
    "rain",
]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("llm-rerank")
    build_tiny_llm_reranker(root / "tiny-qwen3-reranker", seed=11)
    # Same weights' kind, no reranker in the name: a plain LLM unless its setting says so.
    build_tiny_llm_reranker(root / "tiny-qwen3-chat", seed=11)
    build_tiny_llm_reranker(root / "tiny-qwen3-judge", seed=12)
    return root


@pytest.fixture(scope="module")
def server_url(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[str]:
    base = tmp_path_factory.mktemp("base")
    settings = ModelSettingsStore(base / "model_settings.json")
    settings.put("tiny-qwen3-judge", {"model_type": "rerank"})
    with live_server(base, models_dir, profiles=profiles_dir) as server:
        yield server.base_url


def reference_scores(folder: Path, query: str, docs: list[str], task: str = TASK) -> np.ndarray:
    """P(yes) of each document, one unpadded forward each, from the full logits."""
    import mlx.core as mx
    from mlx_lm import load
    from tokenizers import Tokenizer

    model, _ = load(str(folder))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    scores = []
    for doc in docs:
        body = f"<Instruct>: {task}\n<Query>: {query}\n<Document>: {doc}"
        ids = [
            i
            for part in (SYSTEM, body, CLOSE)
            for i in tok.encode(part, add_special_tokens=False).ids
        ]
        logits = np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))
        pair = np.array([logits[no], logits[yes]], np.float64)
        scores.append(np.exp(pair[1] - pair.max()) / np.exp(pair - pair.max()).sum())
    return np.array(scores)


def rerank(url: str, **body: object) -> httpx.Response:
    return httpx.post(url + "/v1/rerank", json=body, timeout=60)


def test_a_folder_named_reranker_is_kind_rerank(server_url: str) -> None:
    models = httpx.get(server_url + "/v1/models").json()["data"]
    kinds = {m["id"]: (m["kind"], m["capabilities"]) for m in models}
    assert kinds["tiny-qwen3-reranker"] == ("rerank", ["rerank"])
    assert kinds["tiny-qwen3-judge"] == ("rerank", ["rerank"])  # by its per-model setting
    assert kinds["tiny-qwen3-chat"][0] == "llm"


def test_scores_are_p_yes_of_the_model_card_prompt(server_url: str, models_dir: Path) -> None:
    expected = reference_scores(models_dir / "tiny-qwen3-reranker", QUERY, DOCS)
    reply = rerank(server_url, model="tiny-qwen3-reranker", query=QUERY, documents=DOCS)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["meta"]["method"] == "llm-yes-no"
    # All documents in one right-padded batch; sorted best first.
    assert [r["index"] for r in body["results"]] == list(np.argsort(-expected, kind="stable"))
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
        assert "document" not in r
    assert body["usage"]["prompt_tokens"] > 0


def test_top_n_return_documents_and_instruction(server_url: str, models_dir: Path) -> None:
    task = "Find passages about pets"
    expected = reference_scores(models_dir / "tiny-qwen3-judge", QUERY, DOCS, task)
    reply = rerank(
        server_url, model="tiny-qwen3-judge", query=QUERY, documents=[{"text": d} for d in DOCS],
        top_n=2, return_documents=True, instruction=task,
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    best = list(np.argsort(-expected, kind="stable")[:2])
    assert [r["index"] for r in results] == best
    assert [r["document"]["text"] for r in results] == [DOCS[i] for i in best]
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)


def test_a_plain_llm_on_rerank_is_a_400_saying_how_to_mark_a_reranker(server_url: str) -> None:
    reply = rerank(server_url, model="tiny-qwen3-chat", query=QUERY, documents=DOCS)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "wrong_model_kind" and error["param"] == "model"
    assert "is an llm model" in error["message"] and "'reranker'" in error["message"]
    assert "model_type 'rerank'" in error["message"]


def test_a_reranker_is_not_an_embedding_model_nor_a_chat_model(server_url: str) -> None:
    embed = httpx.post(
        server_url + "/v1/embeddings", json={"model": "tiny-qwen3-reranker", "input": "x"}
    )
    assert embed.status_code == 400 and "rerank model" in embed.json()["error"]["message"]
    chat = httpx.post(
        server_url + "/v1/chat/completions",
        json={"model": "tiny-qwen3-reranker", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "wrong_model_kind"


def test_a_document_past_the_context_is_a_400_unless_truncated(server_url: str) -> None:
    long_doc = "cats " * 5000  # past the tiny model's 4096 positions
    reply = rerank(server_url, model="tiny-qwen3-reranker", query=QUERY, documents=["a", long_doc])
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "documents[1]"
    cut = rerank(
        server_url, model="tiny-qwen3-reranker", query=QUERY, documents=["a", long_doc],
        truncate=True,
    )  # fmt: skip
    assert cut.status_code == 200, cut.text
    assert len(cut.json()["results"]) == 2
