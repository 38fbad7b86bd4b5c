"""Speculative decoding over HTTP: the per-model setting changed live through the
admin API, the per-request opt-out on every API, its counters in /metrics, and
structured output that stays valid while drafts are verified."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from omlx.api.server import Server
from tests.api.test_structured_output import SCHEMA
from tests.fixtures.prom import scrape, value
from tests.fixtures.servers import live_server

MODEL = "tiny-llama"
SETTINGS = f"/admin/api/models/{MODEL}/settings"
NGRAM = {"method": "ngram", "num_tokens": 4}
# Token ids that repeat: the tiny model's greedy answer repeats pieces of them,
# so prompt-lookup drafts get accepted.
PROMPT = list(range(3, 40)) * 3


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("spec"), tiny_models_dir, profiles=profiles_dir
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def put_settings(server: Server, body: dict) -> httpx.Response:
    return httpx.put(server.base_url + SETTINGS, json=body, timeout=30)


def drafted(server: Server) -> float:
    return value(scrape(server.base_url), "omlx_speculative_drafted_total", model=MODEL)


def complete(client: openai.OpenAI, **extra: object) -> str:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra or None
    )
    return out.choices[0].text


def test_the_setting_turns_speculation_on_live_with_the_same_text(
    server: Server, client: openai.OpenAI
) -> None:
    assert put_settings(server, {"speculative": None}).status_code == 200
    plain = complete(client)
    assert drafted(server) == 0
    saved = put_settings(server, {"speculative": NGRAM})
    assert saved.status_code == 200 and saved.json()["settings"]["speculative"] == NGRAM
    assert complete(client) == plain
    samples = scrape(server.base_url)
    assert value(samples, "omlx_speculative_drafted_total", model=MODEL) > 0
    accepted = value(samples, "omlx_speculative_accepted_total", model=MODEL)
    assert accepted > 0
    rate = value(samples, "omlx_speculative_acceptance_rate", model=MODEL)
    assert rate == pytest.approx(accepted / drafted(server))
    assert value(samples, "omlx_speculative_tokens_per_step", model=MODEL) > 1.0
    # Off again: no more drafts.
    assert put_settings(server, {"speculative": None}).status_code == 200
    before = drafted(server)
    assert complete(client) == plain
    assert drafted(server) == before


def test_a_stop_string_inside_an_accepted_run_ends_the_text_there(
    server: Server, client: openai.OpenAI
) -> None:
    assert put_settings(server, {"speculative": None}).status_code == 200
    whole = complete(client)
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop]
    )
    assert put_settings(server, {"speculative": NGRAM}).status_code == 200
    fast = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop]
    )
    assert fast.choices[0].text == plain.choices[0].text
    assert fast.choices[0].finish_reason == plain.choices[0].finish_reason == "stop"
    assert fast.usage is not None and plain.usage is not None
    assert fast.usage.completion_tokens == plain.usage.completion_tokens


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"speculative": {"method": "ngram", "num_tokens": 0}}, "speculative.num_tokens"),
        ({"speculative": {"method": "ngram", "num_tokens": 99}}, "speculative.num_tokens"),
        ({"speculative": {"method": "beam"}}, "speculative.method"),
        ({"speculative": {"method": "ngram", "k": 3}}, "speculative.k"),
        ({"speculative": 4}, "speculative"),
    ],
)
def test_bad_settings_are_400_naming_the_field(server: Server, body: dict, field: str) -> None:
    resp = put_settings(server, body)
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]


def test_every_api_takes_the_opt_out(server: Server, client: openai.OpenAI) -> None:
    assert put_settings(server, {"speculative": NGRAM}).status_code == 200
    before = drafted(server)
    off = {"speculative": False}
    messages = [{"role": "user", "content": "one two three one two three one two"}]
    client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=off
    )
    complete(client, **off)
    client.responses.create(model=MODEL, input="hello hello", max_output_tokens=12, extra_body=off)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    claude.messages.create(model=MODEL, messages=messages, max_tokens=12, extra_body=off)
    for path, body in (
        ("/api/chat", {"messages": messages}),
        ("/api/generate", {"prompt": "one two three one two"}),
    ):
        resp = httpx.post(
            server.base_url + path,
            json={"model": MODEL, "stream": False, "options": {"num_predict": 12}, **body, **off},
            timeout=60,
        )
        assert resp.status_code == 200
    assert drafted(server) == before  # nobody drafted


def test_a_wrong_opt_out_value_is_400_naming_the_field(
    server: Server, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, speculative="no")
    assert "speculative" in str(err.value)
    resp = httpx.post(
        server.base_url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [], "speculative": 1},
        timeout=30,
    )
    assert resp.status_code == 400 and "speculative" in resp.text


def structured(client: openai.OpenAI, temperature: float, seed: int) -> tuple[str, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    # The prompt shows the shape: drafts copied from it are mostly valid JSON.
    example = json.dumps({"n": 7, "ok": True, "tag": "red"})
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Like {example} or {example}: {example}"}],
        max_tokens=60,
        temperature=temperature,
        seed=seed,
        response_format=fmt,
    )
    return out.choices[0].message.content or "", out.choices[0].finish_reason


def test_structured_output_stays_valid_while_drafts_are_verified(
    server: Server, client: openai.OpenAI
) -> None:
    assert put_settings(server, {"speculative": None}).status_code == 200
    plain = structured(client, 0.0, 0)
    assert put_settings(server, {"speculative": NGRAM}).status_code == 200
    before = drafted(server)
    assert structured(client, 0.0, 0) == plain  # greedy: the same JSON
    assert plain[1] == "stop"
    jsonschema.validate(json.loads(plain[0]), SCHEMA)
    for seed in range(4):
        text, reason = structured(client, 0.8, seed)
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert drafted(server) > before
