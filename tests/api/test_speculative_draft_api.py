"""Draft-model speculative decoding over HTTP: the per-model setting changed live
through the admin API, greedy output identical to plain decoding (batched
rows too), its counters in /metrics, the per-request opt-out, bad draft models
refused with a 400 naming the field, and the memory guard counting the draft."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from omlx.api.server import Server
from tests.api.test_speculative_api import structured
from tests.api.test_structured_output import SCHEMA
from tests.fixtures.prom import scrape, value
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_encoders import build_tiny_decoder_embedder
from tests.fixtures.tiny_models import build_tiny_model, train_tokenizer

MODEL = "tiny-llama"
SETTINGS = f"/admin/api/models/{MODEL}/settings"
# A draft with the target's tokenizer, one layer, other weights: it guesses
# wrong often (rejections, cache cut back); a twin (the target's own files)
# guesses right always.
SMALL = "tiny-llama-small"
TWIN = "tiny-llama-twin"
PROMPTS = [list(range(3, 40)), list(range(50, 70)) * 2, [7, 8, 9] * 10]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("draft-models")
    build_tiny_model(root / MODEL, "llama", seed=0)
    build_tiny_model(root / SMALL, "llama", seed=5, num_hidden_layers=1)
    shutil.copytree(root / MODEL, root / TWIN)
    # Same shapes, another tokenizer: the ids mean other text.
    build_tiny_model(root / "other-vocab", "llama", seed=6)
    train_tokenizer(root / "other-vocab", vocab_size=300)
    build_tiny_decoder_embedder(root / "tiny-embedder", seed=7)
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with live_server(tmp_path_factory.mktemp("draft"), models_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def put_settings(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.put(server.base_url + SETTINGS, json=body, timeout=60)


def use_draft(server: Server, draft: str | None, num_tokens: int = 4) -> None:
    spec = {"method": "draft", "num_tokens": num_tokens, "draft_model": draft} if draft else None
    resp = put_settings(server, {"speculative": spec})
    assert resp.status_code == 200, resp.text
    assert resp.json()["settings"]["speculative"] == spec


def model_status(server: Server) -> dict[str, Any]:
    models = httpx.get(server.base_url + "/admin/api/models", timeout=30).json()
    rows = models["models"] if isinstance(models, dict) else models
    return next(m for m in rows if m["name"] == MODEL)


def counter(server: Server, name: str) -> float:
    return value(scrape(server.base_url), f"omlx_speculative_{name}", model=MODEL)


def complete(client: openai.OpenAI, prompt: list[int], **extra: Any) -> str:
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra or None
    )
    return out.choices[0].text


def complete_all(client: openai.OpenAI) -> list[str]:
    """The prompts at once: rows of one decode batch, each with its own acceptance."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: complete(client, p), PROMPTS))


def test_greedy_output_is_the_plain_output_and_metrics_count_it(
    server: Server, client: openai.OpenAI
) -> None:
    use_draft(server, None)
    plain = [complete(client, p) for p in PROMPTS]
    assert complete_all(client) == plain
    use_draft(server, SMALL)
    assert model_status(server)["speculative"]["draft_model"] == SMALL
    assert [complete(client, p) for p in PROMPTS] == plain
    assert complete_all(client) == plain
    assert counter(server, "drafted_total") > 0
    use_draft(server, TWIN)
    assert model_status(server)["speculative"]["draft_model"] == TWIN
    before = {k: counter(server, f"{k}_total") for k in ("drafted", "accepted", "tokens")}
    before["row_steps"] = counter(server, "row_steps_total")
    assert [complete(client, p) for p in PROMPTS] == plain
    assert complete_all(client) == plain
    samples = scrape(server.base_url)
    now = {k: value(samples, f"omlx_speculative_{k}_total", model=MODEL) for k in before}
    gained = {k: now[k] - before[k] for k in before}
    # The twin proposes what the model picks: (nearly) every draft is kept, and a
    # step hands out several tokens per request.
    assert gained["accepted"] > 0.9 * gained["drafted"] > 0
    assert gained["tokens"] / gained["row_steps"] > 1.5
    rate = value(samples, "omlx_speculative_acceptance_rate", model=MODEL)
    assert rate == pytest.approx(now["accepted"] / now["drafted"])
    assert value(samples, "omlx_speculative_tokens_per_step", model=MODEL) > 1.0


def test_chat_with_a_draft_model_matches_plain_decoding(
    server: Server, client: openai.OpenAI
) -> None:
    messages = [{"role": "user", "content": "one two three one two three one two"}]

    def chat() -> str | None:
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=20, temperature=0
        )
        return out.choices[0].message.content

    use_draft(server, None)
    plain = chat()
    use_draft(server, SMALL, num_tokens=3)
    assert chat() == plain


def test_structured_output_stays_valid_with_drafts_from_the_draft_model(
    server: Server, client: openai.OpenAI
) -> None:
    """The grammar mask judges each drafted position: the small draft guesses
    tokens the grammar forbids, and they are never kept."""
    use_draft(server, None)
    plain = structured(client, 0.0, 0)
    use_draft(server, SMALL)
    before = counter(server, "drafted_total")
    assert structured(client, 0.0, 0) == plain  # greedy: the same JSON
    jsonschema.validate(json.loads(plain[0]), SCHEMA)
    for seed in range(3):
        text, reason = structured(client, 0.8, seed)
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert counter(server, "drafted_total") > before


def test_a_request_that_opts_out_drafts_nothing(server: Server, client: openai.OpenAI) -> None:
    use_draft(server, TWIN)
    before = counter(server, "drafted_total")
    complete(client, PROMPTS[0], speculative=False)
    assert counter(server, "drafted_total") == before
    complete(client, PROMPTS[0])
    assert counter(server, "drafted_total") > before


@pytest.mark.parametrize(
    ("draft", "why"),
    [
        ("no-such-model", "no model 'no-such-model'"),
        ("other-vocab", "tokenizer"),
        ("tiny-embedder", "text LLM"),
    ],
)
def test_a_draft_model_that_cannot_draft_is_400_naming_the_field(
    server: Server, draft: str, why: str
) -> None:
    use_draft(server, None)
    resp = put_settings(
        server, {"speculative": {"method": "draft", "num_tokens": 2, "draft_model": draft}}
    )
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "speculative.draft_model" in message and why in message
    # Nothing was saved.
    assert put_settings(server, {}).json()["settings"]["speculative"] is None


@pytest.mark.parametrize(
    "spec",
    [{"method": "draft", "num_tokens": 2}, {"method": "ngram", "draft_model": SMALL}],
)
def test_draft_model_goes_with_the_draft_method_only(server: Server, spec: dict) -> None:
    resp = put_settings(server, {"speculative": spec})
    assert resp.status_code == 400
    assert "speculative.draft_model" in resp.json()["error"]["message"]


def test_the_guard_counts_the_draft_and_unloading_releases_it(
    server: Server, client: openai.OpenAI
) -> None:
    use_draft(server, None)
    complete(client, PROMPTS[0])
    alone = model_status(server)
    use_draft(server, TWIN)
    complete(client, PROMPTS[0])  # the draft loads on the MLX thread: done by now
    drafting = model_status(server)
    spec = drafting["speculative"]
    assert spec["draft_model"] == TWIN and spec["draft_kv_bytes_per_token"] > 0
    # The twin doubles the weights and the KV every token holds: the KV capacity
    # the guard admits and gates by shrinks.
    assert drafting["memory_bytes"] >= 1.9 * alone["memory_bytes"]
    assert drafting["kv_profile"]["max_kv_tokens"] < alone["kv_profile"]["max_kv_tokens"]
    resp = httpx.post(server.base_url + f"/admin/api/models/{MODEL}/unload", json={}, timeout=60)
    assert resp.status_code == 200
    assert model_status(server)["memory_bytes"] == 0
    # Loaded again, the draft comes with it.
    complete(client, PROMPTS[0])
    assert model_status(server)["speculative"]["draft_model"] == TWIN
