"""/v1/embeddings and /v1/rerank with the built-in all-MiniLM-L6-v2, through the
official openai client (and httpx where no client method exists), against a live
server that also serves a tiny LLM."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest

from omlx.api.server import Server
from omlx.embeddings.inputs import MAX_INPUTS_PER_REQUEST, MAX_TOKENS_PER_REQUEST
from tests.fixtures.bert_reference import ReferenceBert
from tests.fixtures.servers import live_server

MODEL = "all-MiniLM-L6-v2"
SENTENCES = [
    "A man is playing a guitar on stage.",
    "The cat sleeps on the warm windowsill.",
    "Interest rates were raised by the central bank.",
    "How do I reset my password?",
]


@pytest.fixture(scope="module")
def models_dir(
    minilm_path: Path, tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    root = tmp_path_factory.mktemp("embedding-models")
    (root / MODEL).symlink_to(minilm_path)
    (root / "tiny-llama").symlink_to(tiny_models_dir / "tiny-llama")
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with live_server(tmp_path_factory.mktemp("base"), models_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(minilm_path: Path) -> ReferenceBert:
    return ReferenceBert(minilm_path)


def embed(client: openai.OpenAI, texts: list[str] | str, **kw: object) -> np.ndarray:
    reply = client.embeddings.create(model=MODEL, input=texts, **kw)
    assert [d.index for d in reply.data] == list(range(len(reply.data)))
    return np.array([d.embedding for d in reply.data], dtype=np.float64)


def test_vectors_are_normalised_384d_and_match_a_numpy_reference(
    client: openai.OpenAI, reference: ReferenceBert
) -> None:
    reply = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    vectors = np.array([d.embedding for d in reply.data])
    assert vectors.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    expected = np.stack([reference.embed(s) for s in SENTENCES])
    np.testing.assert_allclose(vectors, expected, atol=1e-4)
    tokens = sum(len(reference.tokenizer.encode(s).ids) for s in SENTENCES)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    assert reply.model == MODEL


def test_a_paraphrase_scores_above_an_unrelated_sentence(client: openai.OpenAI) -> None:
    anchor, paraphrase, unrelated = embed(
        client,
        [
            "The weather is lovely today.",
            "It's a really sunny and pleasant day.",
            "The stock market crashed this morning.",
        ],
    )
    assert anchor @ paraphrase > anchor @ unrelated + 0.2


def test_base64_decodes_to_the_same_floats(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": SENTENCES[:2]}
    floats = http.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    packed = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    for f, p in zip(floats["data"], packed["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(p["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(f["embedding"], dtype=np.float32))


def test_token_id_inputs_equal_their_text(client: openai.OpenAI, reference: ReferenceBert) -> None:
    ids = [reference.tokenizer.encode(s).ids for s in SENTENCES[:2]]
    by_text = embed(client, SENTENCES[:2])
    np.testing.assert_allclose(embed(client, ids), by_text, atol=1e-6)  # type: ignore[arg-type]
    np.testing.assert_allclose(embed(client, ids[0])[0], by_text[0], atol=1e-6)  # type: ignore[arg-type]


def test_a_batch_equals_one_at_a_time(client: openai.OpenAI) -> None:
    # Lengths that fall in different padding buckets.
    texts = [f"{s} ({i}{' and more words' * (i % 5)})" for i, s in enumerate(SENTENCES * 10)]
    batch = embed(client, texts)
    alone = np.stack([embed(client, t)[0] for t in texts[:8]])
    np.testing.assert_allclose(batch[:8], alone, atol=1e-5)
    assert batch.shape == (40, 384)


def test_concurrent_requests_share_steps_and_give_the_same_vectors(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    texts = [[f"{s} #{i}" for s in SENTENCES] * 4 for i in range(8)]
    solo = [embed(client, t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda t: embed(client, t), texts))
    for a, b in zip(solo, together, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    models = {m["name"]: m for m in http.get("/admin/api/models").json()["models"]}
    assert models[MODEL]["batching"]["max_requests_in_step"] > 1


def test_rerank_puts_the_relevant_document_first(http: httpx.Client) -> None:
    docs = [
        "Bananas are a good source of potassium.",
        "To reset your password, open Settings and choose 'Forgot password'.",
        {"text": "The Eiffel Tower is in Paris."},
    ]
    reply = http.post(
        "/v1/rerank",
        json={
            "model": MODEL,
            "query": "How do I change my password?",
            "documents": docs,
            "top_n": 2,
            "return_documents": True,
        },
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    results = body["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["relevance_score"] > results[1]["relevance_score"]
    assert results[0]["document"]["text"].startswith("To reset your password")
    assert body["meta"]["method"] == "embedding-cosine"
    assert body["usage"]["total_tokens"] > 0
    plain = http.post("/v1/rerank", json={"model": MODEL, "query": "password", "documents": docs})
    assert len(plain.json()["results"]) == 3 and "document" not in plain.json()["results"][0]


def _error(reply: httpx.Response) -> str:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]["message"]


def test_bounds_and_bad_inputs_are_400_naming_what_to_change(http: httpx.Client) -> None:
    post = lambda body: http.post("/v1/embeddings", json={"model": MODEL, **body})  # noqa: E731
    too_many = ["a"] * (MAX_INPUTS_PER_REQUEST + 1)
    assert str(MAX_INPUTS_PER_REQUEST) in _error(post({"input": too_many}))
    many_tokens = ["word " * 500] * (MAX_TOKENS_PER_REQUEST // 500)
    assert str(MAX_TOKENS_PER_REQUEST) in _error(post({"input": many_tokens}))
    too_long = "word " * 600
    message = _error(post({"input": ["ok", too_long]}))
    assert "input[1]" in message and "512" in message and "truncate" in message
    cut = post({"input": too_long, "truncate": True})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 512
    assert "empty" in _error(post({"input": []}))
    assert "input[0]" in _error(post({"input": [""]}))
    assert "vocabulary" in _error(post({"input": [[101, 999999, 102]]}))
    assert "dimensions" in _error(post({"input": "hi", "dimensions": 128}))
    assert post({"input": "hi", "dimensions": 384}).status_code == 200
    assert "encoding_format" in _error(post({"input": "hi", "encoding_format": "int8"}))
    rerank = http.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": []})
    assert "documents" in _error(rerank)


def test_models_of_the_wrong_kind_are_400_naming_the_kind(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    with pytest.raises(openai.BadRequestError) as llm:
        client.embeddings.create(model="tiny-llama", input="hi")
    assert "tiny-llama" in str(llm.value) and "llm model" in str(llm.value)
    with pytest.raises(openai.BadRequestError) as emb:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "embedding model" in str(emb.value) and "/v1/embeddings" in str(emb.value)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    claude = anthropic.Anthropic(base_url=str(http.base_url), api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="embedding model"):
        claude.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    rerank = http.post("/v1/rerank", json={"model": "tiny-llama", "query": "q", "documents": ["d"]})
    assert "llm model" in _error(rerank)


def test_the_model_is_listed_with_its_kind(client: openai.OpenAI, http: httpx.Client) -> None:
    listed = {m.id: m for m in client.models.list().data}
    assert listed[MODEL].kind == "embedding"  # type: ignore[attr-defined]
    assert listed["tiny-llama"].kind == "llm"  # type: ignore[attr-defined]
    admin = {m["name"]: m for m in http.get("/admin/api/models").json()["models"]}
    assert admin[MODEL]["kind"] == "embedding" and admin["tiny-llama"]["kind"] == "llm"


def test_status_routes_report_a_loaded_embedding_model(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    client.embeddings.create(model=MODEL, input="hi")
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert f'omlx_memory_gate_ended_total{{model="{MODEL}"}} 0.0' in metrics.text
    health = {m["name"]: m for m in http.get("/health").json()["loaded_models"]}
    assert health[MODEL]["finished"]["stop"] > 0
    for path in ("/admin/api/stats", "/admin/api/memory", "/api/ps", "/api/tags"):
        assert http.get(path).status_code == 200, path
    ps = {m["name"]: m for m in http.get("/api/ps").json()["models"]}
    assert MODEL + ":latest" in ps
    # Coding agents are offered chat models only.
    connect = http.get("/admin/api/connect").json()
    assert connect["models"] == ["tiny-llama"] and connect["model"] == "tiny-llama"
    clear = http.post("/admin/api/cache/clear", json={"model": MODEL})
    assert clear.status_code == 400 and "no prefix cache" in clear.json()["error"]["message"]


def test_ollama_embed_and_legacy_embeddings(server: Server, reference: ReferenceBert) -> None:
    client = ollama.Client(host=server.base_url)
    reply = client.embed(model=MODEL + ":latest", input=SENTENCES[:2])
    vectors = np.array(reply.embeddings)
    np.testing.assert_allclose(vectors, [reference.embed(s) for s in SENTENCES[:2]], atol=1e-4)
    assert reply.model == MODEL + ":latest" and reply.prompt_eval_count > 0
    # Ollama cuts long inputs unless told not to.
    long_text = "word " * 600
    assert len(client.embed(model=MODEL, input=long_text).embeddings[0]) == 384
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=MODEL, input=long_text, truncate=False)
    assert refused.value.status_code == 400 and "512" in refused.value.error
    legacy = client.embeddings(model=MODEL, prompt=SENTENCES[0])
    np.testing.assert_allclose(legacy.embedding, vectors[0], atol=1e-6)
    with pytest.raises(ollama.ResponseError) as llm:
        client.embed(model="tiny-llama", input="hi")
    assert llm.value.status_code == 400 and "llm model" in llm.value.error
