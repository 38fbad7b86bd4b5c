"""Chat templates cannot freeze the server: a request brings no template of its own,
and a model's slow template is stopped at its deadline while every route keeps
answering. Stop strings are capped. Attacked through the official clients."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_models import CHATML, build_tiny_model

# Ten billion loop iterations: hours of rendering if nothing stops it.
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
SLOW_TRIGGER = "please render slowly"
# A model whose own template is slow for one message, and prints a template variable.
SLOW_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == '" + SLOW_TRIGGER + "' %}" + BOMB + "{% endif %}"
    "{% endfor %}" + CHATML + "{% if note is defined %}{{ note }}{% endif %}"
)
TIMEOUT_S = 2.0
ASK = [{"role": "user", "content": "What is the capital of France?"}]
SLOW_ASK = [{"role": "user", "content": SLOW_TRIGGER}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template-models")
    build_tiny_model(root / "tiny-llama", "llama", seed=0)
    slow = build_tiny_model(root / "slow-template", "llama", seed=3)
    config_path = slow / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": SLOW_TEMPLATE}))
    return root


@pytest.fixture(scope="module")
def server(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("base")
    with live_server(
        base, models_dir, server={"template_timeout_s": TIMEOUT_S}, profiles=profiles_dir
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, model: str = "tiny-llama", messages=ASK, **extra):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, extra_body=extra or None
    )


def test_a_request_cannot_bring_its_own_template(client: openai.OpenAI) -> None:
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, chat_template_kwargs={"chat_template": BOMB})

    assert time.perf_counter() - start < 1.0
    error = caught.value.body
    assert error["param"] == "chat_template_kwargs.chat_template"
    assert "not a template variable" in error["message"]


@pytest.mark.parametrize(
    "key",
    [
        "tokenize",
        "return_dict",
        "tokenizer_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "__class__",
        "_private",
        "namespace",
    ],
)
def test_renderer_parameters_and_callable_names_are_refused(client: openai.OpenAI, key) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, chat_template_kwargs={key: True})

    assert caught.value.body["param"] == f"chat_template_kwargs.{key}"


def test_oversized_template_values_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, chat_template_kwargs={"note": "x" * 1025})

    assert caught.value.body["param"] == "chat_template_kwargs.note"
    assert "1024 characters" in caught.value.body["message"]


def test_template_variables_still_reach_the_template(client: openai.OpenAI) -> None:
    plain = chat(client, "slow-template")
    noted = chat(
        client,
        "slow-template",
        chat_template_kwargs={"note": "one two three four", "enable_thinking": False},
    )

    assert noted.usage.prompt_tokens > plain.usage.prompt_tokens


def renders_stop_running(server: Server, within_s: float) -> bool:
    """Whether no template render is left running in the (in-process) server soon."""
    deadline = time.monotonic() + within_s
    while server.app.state.omlx.render_pool.running():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def health_times_while(server: Server, worker: threading.Thread) -> list[float]:
    """Start ``worker`` and time ``/health`` every 0.1 s until it ends."""
    worker.start()
    health_s = []
    while worker.is_alive():
        start = time.perf_counter()
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        health_s.append(time.perf_counter() - start)
        time.sleep(0.1)
    worker.join()
    return health_s


def slow_chat(server: Server, results: list, model: str = "slow-template") -> None:
    """A chat request whose rendering takes forever; appends (status, body, seconds)."""
    start = time.perf_counter()
    response = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": model, "messages": SLOW_ASK, "max_tokens": 4},
        timeout=60,
    )
    results.append((response.status_code, response.json(), time.perf_counter() - start))


def test_health_answers_while_a_slow_template_renders_and_the_render_stops(
    server: Server, client: openai.OpenAI
) -> None:
    chat(client, "slow-template")  # loaded, so only rendering is timed below
    results: list = []
    worker = threading.Thread(target=slow_chat, args=(server, results))
    health_s = health_times_while(server, worker)

    assert len(health_s) >= 5  # polled through the whole render
    assert max(health_s) < 1.0
    status, body, seconds = results[0]
    assert status == 400
    assert body["error"]["param"] == "messages"
    assert (
        f"the chat template took longer than {TIMEOUT_S:g} s to render" in body["error"]["message"]
    )
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.0
    # The runaway render was stopped, not left burning a core in the background.
    assert renders_stop_running(server, within_s=1.0)
    # And the server goes on: other models and the same one render normally.
    assert chat(client).choices[0].finish_reason in ("stop", "length")
    assert chat(client, "slow-template").choices[0].finish_reason in ("stop", "length")


def test_several_slow_renders_each_end_on_time(server: Server) -> None:
    results: list = []
    workers = [threading.Thread(target=slow_chat, args=(server, results)) for _ in range(5)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    assert [status for status, _, _ in results] == [400] * 5
    assert max(seconds for _, _, seconds in results) < TIMEOUT_S + 2.0
    assert renders_stop_running(server, within_s=1.0)


def test_the_render_bound_changes_live_from_the_admin_api(server: Server) -> None:
    def set_bound(seconds: float) -> None:
        changed = httpx.put(
            server.base_url + "/admin/api/settings",
            json={"server": {"template_timeout_s": seconds}},
            timeout=30,
        )
        assert changed.status_code == 200, changed.text
        assert "server.template_timeout_s" in changed.json()["applied"]

    set_bound(0.5)
    try:
        results: list = []
        slow_chat(server, results)
    finally:
        set_bound(TIMEOUT_S)
    [(status, body, _)] = results
    assert status == 400
    assert "took longer than 0.5 s" in body["error"]["message"]


def test_an_imported_gguf_template_gets_the_same_bound(
    server: Server, client: openai.OpenAI, tmp_path: Path
) -> None:
    from tests.unit.test_gguf_import import (
        MIXED_TYPES,
        gguf_tensors,
        random_weights,
        train_tokenizer,
        write_gguf,
    )

    tokenizer = train_tokenizer("smollm")
    tensors = gguf_tensors(random_weights(tokenizer.get_vocab_size()), MIXED_TYPES, tied=False)
    source = write_gguf(tmp_path / "slow.gguf", tokenizer, tensors, chat_template=SLOW_TEMPLATE)
    imported = httpx.post(
        server.base_url + "/admin/api/models/import-gguf",
        json={"path": str(source), "name": "slow-gguf"},
        headers={"X-Omlx-Client": "test"},
        timeout=300,
    )
    assert imported.status_code == 200, imported.text
    # The file's own template renders ordinary messages...
    assert chat(client, "slow-gguf").choices[0].finish_reason in ("stop", "length")
    # ...and is stopped at the bound when it loops.
    results: list = []
    slow_chat(server, results, model="slow-gguf")
    [(status, body, seconds)] = results
    assert status == 400
    assert "took longer than" in body["error"]["message"]
    assert seconds < TIMEOUT_S + 2.0
    assert renders_stop_running(server, within_s=1.0)


def test_anthropic_route_has_the_same_render_bound(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    start = time.perf_counter()
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="slow-template", messages=SLOW_ASK, max_tokens=4)

    assert time.perf_counter() - start < TIMEOUT_S + 2.0
    assert "took longer than" in caught.value.body["error"]["message"]


def test_health_answers_while_a_huge_prompt_is_tokenized(server: Server) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 100_000  # 4.5 MB
    results: list = []

    def complete() -> None:
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        results.append((response.status_code, response.json()))

    worker = threading.Thread(target=complete)
    health_s = health_times_while(server, worker)

    assert len(health_s) >= 3  # it was tokenizing for a while
    assert max(health_s) < 1.0
    status, body = results[0]
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded")


# ---- stop strings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "in_message"),
    [
        ({"stop": ["x" * 257]}, "stop", "at most 256 characters"),
        ({"stop": "x" * 10_000}, "stop", "at most 256 characters"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16 stop sequences"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "64"),
    ],
)
def test_stop_over_the_caps_is_refused(client: openai.OpenAI, extra, param, in_message) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **extra)

    assert caught.value.body["param"] == param
    assert in_message in caught.value.body["message"]


def test_stop_at_the_caps_is_accepted(client: openai.OpenAI) -> None:
    stops = ["x" * 256] + [f"never-{i}" for i in range(15)]

    out = chat(client, stop=stops, stop_token_ids=list(range(64)))

    assert out.choices[0].finish_reason in ("stop", "length")


def test_anthropic_stop_sequences_are_capped(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="tiny-llama", messages=ASK, max_tokens=4, stop_sequences=["x" * 257]
        )

    assert "stop_sequences" in caught.value.body["error"]["message"]
    assert "at most 256 characters" in caught.value.body["error"]["message"]
