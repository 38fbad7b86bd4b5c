"""The OpenAI-compatible API through the official `openai` client, on a live server."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from omlx.api.output_budget import CLAMPED_HEADER
from omlx.api.server import Server
from tests.fixtures.frozen_probe import FrozenProbe
from tests.fixtures.servers import aborted_count, live_server, wait_aborted

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client: openai.OpenAI, messages=CHAT, **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        messages=messages, **{"model": MODEL, "temperature": 0, "max_tokens": 24, **kw}
    )


def chat_stream(client: openai.OpenAI, messages=CHAT, **kw) -> tuple[str, list]:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            **{"temperature": 0, "max_tokens": 24, **kw},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def wait_idle(server: Server, timeout_s: float = 10.0) -> None:
    """Until no loaded model has requests in flight (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(server.base_url + "/health").json()
        if all(m["requests_in_flight"] == 0 for m in health["loaded_models"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight: {health}")


def test_health_answers_before_any_model_is_loaded(server: Server) -> None:
    body = httpx.get(server.base_url + "/health").json()
    assert body["status"] == "ok" and body["version"]


def test_models_list(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"tiny-llama", "tiny-qwen3"} <= ids


def test_models_retrieve_returns_the_listed_entry(client: openai.OpenAI) -> None:
    listed = {m.id: m for m in client.models.list()}
    model = client.models.retrieve("tiny-qwen3")
    assert model == listed["tiny-qwen3"]  # id, object, created, owned_by, state
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    assert "Available models:" in missing.value.body["message"]
    assert "tiny-llama" in missing.value.body["message"]


def test_chat_non_streaming_has_text_usage_and_finish_reason(client: openai.OpenAI) -> None:
    out = chat(client, max_tokens=12)
    assert out.object == "chat.completion" and out.model == MODEL
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens > 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streamed_chat_text_equals_non_streamed(client: openai.OpenAI) -> None:
    full = chat(client, max_tokens=30)
    text, chunks = chat_stream(client, max_tokens=30)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage_sends_a_final_usage_chunk(client: openai.OpenAI) -> None:
    _, chunks = chat_stream(client, max_tokens=7, stream_options={"include_usage": True})
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 7
    assert last.usage.total_tokens == last.usage.prompt_tokens + 7


def test_stop_string_truncates_output(client: openai.OpenAI) -> None:
    full = chat(client, max_tokens=40).choices[0].message.content
    stop = full[12:15]
    expected = full[: full.index(stop)]
    out = chat(client, max_tokens=40, stop=[stop, "never-appears"])
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == "stop"
    text, chunks = chat_stream(client, max_tokens=40, stop=stop)
    assert text == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    out = client.completions.create(**kw)
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 16
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_with_a_list_of_prompts_gives_one_choice_each(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "1 2 3 4"]
    kw = {"model": MODEL, "max_tokens": 10, "temperature": 0}
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    out = client.completions.create(prompt=prompts, **kw)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == singles
    assert out.usage.completion_tokens == 20
    streamed = ["", ""]
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == singles


def test_completions_accept_token_ids(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4)
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 4


def test_sixteen_concurrent_streams_each_equal_their_solo_output(
    client: openai.OpenAI, server: Server
) -> None:
    questions = [
        [{"role": "user", "content": f"Question {i}: count to {i * 7}"}] for i in range(16)
    ]
    solo = [
        chat(client, q, max_tokens=20 + i).choices[0].message.content
        for i, q in enumerate(questions)
    ]

    def one(i: int) -> str:
        return chat_stream(client, questions[i], max_tokens=20 + i)[0]

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, range(16)))
    assert together == solo
    wait_idle(server)


# Decodes ~60 tok/s: a 4000-token request is still running a minute later.
SLOW = "slow-llama"
# Greedy, so the reply cannot end by chance in its first tokens (a sampled one from a
# random model sometimes does), before the disconnect is seen.
GREEDY = {"temperature": 0}


def test_client_disconnect_mid_stream_aborts_and_the_server_keeps_serving(
    client: openai.OpenAI, server: Server
) -> None:
    chat(client, model=SLOW, max_tokens=1)  # the model is loaded
    before = aborted_count(server, SLOW)
    body = {"model": SLOW, "messages": CHAT, "max_tokens": 4000, "stream": True, **GREEDY}
    with (
        httpx.Client(base_url=server.base_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
    # Leaving the block closed the connection mid-stream.
    wait_aborted(server, SLOW, before + 1)
    wait_idle(server)
    assert chat(client, max_tokens=5).choices[0].finish_reason == "length"


def test_non_streaming_client_disconnect_aborts_the_request(
    client: openai.OpenAI, server: Server
) -> None:
    chat(client, model=SLOW, max_tokens=1)
    before = aborted_count(server, SLOW)
    body = {"model": SLOW, "messages": CHAT, "max_tokens": 4000, **GREEDY}
    try:
        resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=0.05)
    except httpx.ReadTimeout:
        pass  # the client gave up while the server was generating
    else:
        pytest.fail(f"answered before the client left: {resp.status_code} {resp.text[:300]}")
    wait_aborted(server, SLOW, before + 1)
    wait_idle(server)


# ---- errors: status and OpenAI envelope ------------------------------------------


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_unknown_model_is_404_listing_available_models(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=CHAT)
    err = error_of(info.value)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "tiny-llama" in err["message"] and "tiny-qwen3" in err["message"]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 9}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ],
)
def test_out_of_range_input_is_400_naming_the_field(server: Server, extra, field) -> None:
    body = {"model": MODEL, "messages": CHAT, **extra}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field
    assert field in err["message"]


def test_missing_and_malformed_bodies_are_400(server: Server) -> None:
    url = server.base_url + "/v1/chat/completions"
    missing = httpx.post(url, json={"model": MODEL})
    assert (
        missing.status_code == 400
        and "'messages' is required" in missing.json()["error"]["message"]
    )
    broken = httpx.post(
        url, content=b'{"model": "x", ', headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]


def test_prompt_longer_than_the_context_window_is_400(client: openai.OpenAI) -> None:
    long_prompt = [{"role": "user", "content": "the cache " * 3000}]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, long_prompt)
    err = error_of(info.value)
    assert err["code"] == "context_length_exceeded" and "4096" in err["message"]


def test_max_tokens_beyond_the_context_window_is_served_clamped_to_the_room_left(
    client: openai.OpenAI,
) -> None:
    """An agent's fixed budget larger than the window: the stream starts (200) and
    its header names the budget granted; the client leaves once it has read it."""
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=CHAT, max_tokens=5000, stream=True
    ) as response:
        assert response.status_code == 200
        clamp = dict(p.split("=") for p in response.headers[CLAMPED_HEADER].split("; "))
    prompt_tokens = chat(client, max_tokens=1).usage.prompt_tokens
    assert clamp == {
        "requested": "5000",
        "granted": str(4096 - prompt_tokens),
        "prompt_tokens": str(prompt_tokens),
        "context_window": "4096",
    }


def test_token_ids_outside_the_vocabulary_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, 10_000_000])
    assert "vocabulary" in error_of(info.value)["message"]


def test_unsupported_features_are_refused_not_ignored(client: openai.OpenAI) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, image)
    assert "image_url" in error_of(info.value)["message"]


def test_completions_echo_prefixes_the_prompt(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(echo=True, **kw).choices[0].text
    assert echoed == "Once upon a time" + plain
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kw)
    )
    assert streamed == echoed


def test_a_prompt_over_the_memory_limit_is_400_with_the_numbers(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    """The front door refuses a prompt whose cache cannot fit under the limit beside the
    loaded model, with the numbers; a tiny prompt under the same limit is served. The
    readings are frozen once the model is loaded (tests/fixtures/frozen_probe.py, a
    fake): the live baseline is this whole test process's footprint, which moved by
    more than tiny-llama's whole KV capacity here between the test's reading and the
    requests in full runs (the long prompt's own tokenizing, earlier tests' garbage)."""
    import dataclasses

    with live_server(
        tmp_path, tiny_models_dir, scheduler={"prefill_step_size": 64}, profiles=profiles_dir
    ) as srv:
        probe = srv.pool.probe = FrozenProbe()
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        chat(client, max_tokens=1)  # loaded, measured with real readings
        probe.held = probe.reading(fresh=True).in_use_bytes
        chat(client, max_tokens=1)  # the idle baseline observed at the frozen figure
        guard = next(e for e in srv.pool.loaded() if e.name == MODEL).guard
        before = guard.limits
        # The lowest limit whose KV capacity holds 1024 tokens (the capacity keeps the
        # measured transient and a canary free): a 16-token prompt's cache (272 columns
        # as it grows) fits, a ~2,400-token one does not.
        low, ceiling = guard.baseline_bytes, before.hard_bytes
        while ceiling - low > 2**16:
            mid = (low + ceiling) // 2
            guard.publish(dataclasses.replace(before, hard_bytes=mid))
            low, ceiling = (low, mid) if (guard.max_kv_tokens or 0) >= 1024 else (mid, ceiling)
        guard.publish(dataclasses.replace(before, hard_bytes=ceiling))
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, [{"role": "user", "content": "the cache " * 1200}])
        err = info.value.response.json()["error"]
        assert err["code"] == "prefill_memory_exceeded" and err["type"] == "invalid_request_error"
        assert err["limit_bytes"] == ceiling and err["estimated_bytes"] > ceiling
        assert "memory limit" in err["message"]
        assert chat(client, max_tokens=2).choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT}),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi"}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": CHAT}),
    ],
)
def test_a_stream_flag_of_the_wrong_type_is_a_400(server: Server, path: str, body: dict) -> None:
    # OpenAI answers 400 for "stream": "yes"; taking it as true would start an SSE
    # stream the client never asked for in a form it can parse.
    answer = httpx.post(server.base_url + path, json={**body, "stream": "yes"}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert "stream" in answer.text
    ok = httpx.post(server.base_url + path, json={**body, "stream": False, "max_tokens": 4})
    assert ok.status_code == 200, ok.text
