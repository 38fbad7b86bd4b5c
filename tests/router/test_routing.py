"""Through the router, with the official clients: chat, streams, prefix affinity,
least-loaded spread, per-model routing, merged models, auth, metrics, disconnects."""

from __future__ import annotations

import time
from collections import Counter

import anthropic
import httpx
import ollama
import openai
import pytest

from omlx.router.config import BackendSpec
from omlx.router.proxy import BACKEND_HEADER
from tests.fixtures.prom import scrape, value
from tests.fixtures.servers import aborted_count, wait_aborted
from tests.router.conftest import C_KEY, ROUTER_KEY, Fleet, start_router

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.router.base_url + "/v1", api_key=ROUTER_KEY, max_retries=0)


def chat(client: openai.OpenAI, text: str, model: str = MODEL) -> tuple[str, object]:
    """(backend URL that served it, the completion)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=4,
        temperature=0,
    )
    return raw.headers[BACKEND_HEADER], raw.parse()


def test_chat_completion_through_the_router(fleet: Fleet, client: openai.OpenAI) -> None:
    backend, reply = chat(client, "Say hello through the router.")
    assert backend in fleet.backends
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1


def test_anthropic_messages_with_x_api_key(fleet: Fleet) -> None:
    client = anthropic.Anthropic(base_url=fleet.router.base_url, api_key=ROUTER_KEY, max_retries=0)
    message = client.messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hello, Claude router."}]
    )
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens >= 1
    with client.messages.stream(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Stream, Claude."}]
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1


def test_stream_chunks_arrive_as_generated(fleet: Fleet, client: openai.OpenAI) -> None:
    # 200 tokens of slow-llama take a second or more to generate, so chunks relayed as
    # they come spread over far more than 0.2 s; a buffering relay sends them at once.
    arrivals = []
    stream = client.chat.completions.create(
        model="slow-llama",
        messages=[{"role": "user", "content": "Stream this, token by token."}],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    assert len(arrivals) >= 8, arrivals
    # Buffered relaying would deliver everything at once, at the end.
    assert arrivals[-1] - arrivals[0] > 0.2, arrivals


def test_repeated_long_prompt_lands_on_its_cache(fleet: Fleet, client: openai.OpenAI) -> None:
    long_prompt = "The router should keep this long shared document on one backend. " * 20
    first, _ = chat(client, long_prompt)
    headers = {"Authorization": f"Bearer {ROUTER_KEY}"}
    before = value(scrape(fleet.router.base_url, headers), "omlx_router_requests_routed_total",
                   backend=first, reason="affinity")  # fmt: skip
    for i in range(3):
        chat(client, f"An unrelated short question number {i}.")  # moves least-loaded on
        again, reply = chat(client, long_prompt)
        assert again == first
        assert reply.usage.prompt_tokens_details.cached_tokens >= 16
    after = value(scrape(fleet.router.base_url, headers), "omlx_router_requests_routed_total",
                  backend=first, reason="affinity")  # fmt: skip
    assert after == before + 3


def wait_all_idle(fleet: Fleet, timeout_s: float = 10.0) -> None:
    """Until every backend is healthy and idle by the router's last poll (earlier
    tests leave streams ending and backends coming back)."""
    headers = {"Authorization": f"Bearer {ROUTER_KEY}"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = httpx.get(fleet.router.base_url + "/health", headers=headers).json()["backends"]
        if all(r["healthy"] and not r["in_flight"] and not r["requests_in_flight"] for r in rows):
            return
        time.sleep(0.1)
    raise AssertionError(f"backends not idle: {rows}")


def test_distinct_prompts_spread_over_idle_backends(fleet: Fleet, client: openai.OpenAI) -> None:
    wait_all_idle(fleet)
    served = Counter(
        chat(client, f"Distinct question {i}: what is {i} + {i}?")[0] for i in range(6)
    )
    assert set(served) == set(fleet.backends)


def test_busy_backend_is_avoided(fleet: Fleet, client: openai.OpenAI) -> None:
    with httpx.stream(
        "POST",
        fleet.router.base_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {ROUTER_KEY}"},
        json={
            "model": "slow-llama",
            "messages": [{"role": "user", "content": "Keep this backend busy."}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=60,
    ) as busy:
        busy_backend = busy.headers[BACKEND_HEADER]
        for served in (chat(client, f"Meanwhile, question {i}?")[0] for i in range(4)):
            assert served != busy_backend


def test_model_served_by_one_backend_routes_there(fleet: Fleet, client: openai.OpenAI) -> None:
    for i in range(3):
        backend, _ = chat(client, f"Only C has this model ({i}).", model="tiny-qwen3")
        assert backend == fleet.c.base_url


def test_models_are_merged_with_their_backends(fleet: Fleet, client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-llama", "slow-llama", "tiny-qwen3"}
    assert sorted(models["tiny-llama"].backends) == sorted(fleet.backends)
    assert models["tiny-qwen3"].backends == [fleet.c.base_url]


def test_router_key_is_required(fleet: Fleet) -> None:
    anonymous = openai.OpenAI(
        base_url=fleet.router.base_url + "/v1", api_key="wrong", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    assert httpx.get(fleet.router.base_url + "/metrics").status_code == 401
    assert httpx.get(fleet.router.base_url + "/health").status_code == 200


def test_metrics_show_each_backend(fleet: Fleet, client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {ROUTER_KEY}"}
    chat(client, "Count me in the router's metrics.")
    samples = scrape(fleet.router.base_url, headers=headers)
    for url in fleet.backends:
        assert value(samples, "omlx_router_backend_up", backend=url) == 1
    routed = sum(s.value for s in samples if s.name == "omlx_router_requests_routed_total")
    assert routed >= 1


def test_client_disconnect_aborts_upstream(fleet: Fleet) -> None:
    body = {
        "model": "slow-llama",
        "messages": [{"role": "user", "content": "A long answer the client abandons."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {ROUTER_KEY}"}
    before = {url: _aborted(s) for url, s in fleet.backends.items()}
    with httpx.stream(
        "POST", fleet.router.base_url + "/v1/chat/completions", json=body, headers=headers,
        timeout=60,
    ) as response:  # fmt: skip
        backend = response.headers[BACKEND_HEADER]
        chunks = response.iter_bytes()
        next(chunks)
        next(chunks)
    wait_aborted(fleet.backends[backend], "slow-llama", before[backend] + 1)


def _aborted(server: object) -> int:
    try:
        return aborted_count(server, "slow-llama")  # type: ignore[arg-type]
    except StopIteration:  # not loaded there yet
        return 0


def test_responses_follow_up_goes_to_the_backend_that_stored_it(
    fleet: Fleet, client: openai.OpenAI
) -> None:
    first = client.responses.with_raw_response.create(
        model=MODEL, input="Remember the word 'teal'.", max_output_tokens=4, store=True
    )
    owner, stored = first.headers[BACKEND_HEADER], first.parse()
    for i in range(3):  # distinct prompts would move least-loaded on; the id pins it
        follow = client.responses.with_raw_response.create(
            model=MODEL,
            input=f"Follow-up {i}: which word?",
            previous_response_id=stored.id,
            max_output_tokens=4,
        )
        assert follow.headers[BACKEND_HEADER] == owner
    streamed = client.responses.create(
        model=MODEL, input="Streamed and stored.", max_output_tokens=4, stream=True
    )
    ends = ("response.completed", "response.incomplete")
    streamed_id = next(e.response.id for e in streamed if e.type in ends)
    assert client.responses.retrieve(streamed_id).id == streamed_id
    # A router that never saw these ids still finds them, by asking each backend.
    other = start_router(
        [BackendSpec(u, C_KEY if u == fleet.c.base_url else None) for u in fleet.backends]
    )
    try:
        fresh = openai.OpenAI(base_url=other.base_url + "/v1", api_key="unused", max_retries=0)
        for response_id in (stored.id, streamed_id):
            assert fresh.responses.retrieve(response_id).id == response_id
        with pytest.raises(openai.NotFoundError):
            fresh.responses.retrieve("resp_nowhere")
    finally:
        other.stop()
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)


def test_ollama_chat_and_tags(fleet: Fleet) -> None:
    client = ollama.Client(
        host=fleet.router.base_url, headers={"Authorization": f"Bearer {ROUTER_KEY}"}
    )
    names = {m.model for m in client.list().models}
    assert names == {"tiny-llama:latest", "slow-llama:latest", "tiny-qwen3:latest"}
    for _ in range(3):  # only C has it, under Ollama's name too
        reply = client.chat(
            model="tiny-qwen3:latest",
            messages=[{"role": "user", "content": "Hello from Ollama's client."}],
            options={"num_predict": 4},
        )
        assert reply.message.role == "assistant" and reply.eval_count >= 1
    reply = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello from Ollama's client."}],
        options={"num_predict": 4},
    )
    assert reply.message.role == "assistant" and reply.eval_count >= 1


def test_client_giving_up_on_a_non_streamed_answer_aborts_upstream(fleet: Fleet) -> None:
    body = {
        "model": "slow-llama",
        "messages": [{"role": "user", "content": "A long answer nobody waits for."}],
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    before = {url: _aborted(s) for url, s in fleet.backends.items()}
    headers = {"Authorization": f"Bearer {ROUTER_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            fleet.router.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=1.5
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = {url: _aborted(s) for url, s in fleet.backends.items()}
        if sum(after.values()) > sum(before.values()):
            break
        time.sleep(0.05)
    assert sum(after.values()) == sum(before.values()) + 1


def test_anthropic_sdk_lists_and_retrieves_models(fleet: Fleet) -> None:
    client = anthropic.Anthropic(base_url=fleet.router.base_url, api_key=ROUTER_KEY, max_retries=0)
    listed = [m.id for m in client.models.list()]
    assert listed == ["slow-llama", "tiny-llama", "tiny-qwen3"]
    assert client.models.retrieve("tiny-qwen3").id == "tiny-qwen3"
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")
    openai_client = openai.OpenAI(
        base_url=fleet.router.base_url + "/v1", api_key=ROUTER_KEY, max_retries=0
    )
    assert openai_client.models.retrieve("tiny-llama").id == "tiny-llama"


def test_same_origin_page_is_served_and_foreign_one_refused(fleet: Fleet) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    own = {"Authorization": f"Bearer {ROUTER_KEY}", "Origin": fleet.router.base_url}
    url = fleet.router.base_url + "/v1/chat/completions"
    assert httpx.post(url, json=body, headers=own, timeout=60).status_code == 200
    foreign = {**own, "Origin": "https://evil.example"}
    refused = httpx.post(url, json=body, headers=foreign, timeout=60)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "cross_site_request"
