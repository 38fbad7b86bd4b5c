"""An embedding model shares the pool's weights budget, LRU and pinning with LLMs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.fixtures.servers import live_server

MODEL = "all-MiniLM-L6-v2"
LLM = "slow-llama"  # 128 MB of weights: with MiniLM's 91 MB, over the 150 MB budget


@pytest.fixture(scope="module")
def http(
    minilm_path: Path, tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("pool-models")
    (root / MODEL).symlink_to(minilm_path)
    (root / LLM).symlink_to(tiny_models_dir / LLM)
    base = tmp_path_factory.mktemp("pool-base")
    with (
        live_server(base, root, memory={"max_model_memory": 150_000_000}) as server,
        httpx.Client(base_url=server.base_url, timeout=120) as client,
    ):
        server.pool.residents.busy_wait_s = 0.5  # a load blocked by a pin gives up quickly
        yield client


def _states(http: httpx.Client) -> dict[str, str]:
    return {m["name"]: m["state"] for m in http.get("/admin/api/models").json()["models"]}


def test_embedding_model_is_evicted_and_pinned_like_an_llm(http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x", max_retries=0)
    client.embeddings.create(model=MODEL, input="hello")
    assert _states(http) == {MODEL: "loaded", LLM: "unloaded"}
    # Loading the LLM evicts the least recently used model: the embedding model.
    assert http.post(f"/admin/api/models/{LLM}/load", json={}).status_code == 200
    assert _states(http) == {MODEL: "unloaded", LLM: "loaded"}
    settings = f"/admin/api/models/{MODEL}/settings"
    assert http.put(settings, json={"pinned": True}).status_code == 200
    try:
        assert len(client.embeddings.create(model=MODEL, input="hello").data[0].embedding) == 384
        assert _states(http) == {MODEL: "pinned", LLM: "unloaded"}
        # Pinned, it is never evicted: the LLM cannot come back (507 naming the pin).
        refused = http.post(f"/admin/api/models/{LLM}/load", json={})
        assert refused.status_code == 507 and MODEL in refused.json()["error"]["message"]
    finally:
        http.delete(settings)
