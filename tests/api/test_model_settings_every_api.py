"""A model's settings hold on every API: its chat_template_kwargs (and their locks),
its sampling defaults with force_sampling, and its max_tokens, through the official
OpenAI (chat and Responses), Anthropic and Ollama clients against a live server.

The model's chat template adds a system turn when ``enable_thinking`` is false, so
the template kwargs in force change the prompt and therefore the greedy answer."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from omlx.api.output_budget import CLAMPED_HEADER
from omlx.api.server import Server
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_models import CHATML, build_tiny_model

MODEL = "quiet-llama"
QUIET = (
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<|im_start|>system\\nthink quietly<|im_end|>\\n' }}{% endif %}"
)
PROMPT = "Once upon a time"
NUM_TOKENS = 6
SETTINGS = f"/admin/api/models/{MODEL}/settings"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("models")
    folder = build_tiny_model(models / MODEL, "llama", seed=3)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QUIET + CHATML
    config_path.write_text(json.dumps(config))
    with live_server(
        tmp_path_factory.mktemp("base"), models, cache={"enabled": False}, profiles=profiles_dir
    ) as srv:
        yield srv


@pytest.fixture()
def model_settings(server: Server) -> Iterator[Callable[[dict[str, Any]], None]]:
    # A script, not a web page: the header the origin guard asks of a bodiless DELETE.
    http = httpx.Client(base_url=server.base_url, timeout=60, headers={"X-Omlx-Client": "tests"})

    def put(values: dict[str, Any]) -> None:
        assert http.put(SETTINGS, json=values).status_code == 200

    yield put
    assert http.delete(SETTINGS).status_code == 200
    http.close()


# Each API: (text, prompt tokens, output tokens) of one turn; ``wants`` is what the
# request asks: temperature, max tokens (None: not sent) and enable_thinking.
Answer = tuple[str, int, int]


def _openai_chat(server: Server, temperature: float, max_tokens: int | None, think: bool) -> Answer:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    extra: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": think}}
    if max_tokens is not None:
        extra["max_tokens"] = max_tokens
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=temperature,
        extra_body=extra,
    )
    usage = reply.usage
    assert usage is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens, usage.completion_tokens


def _responses(server: Server, temperature: float, max_tokens: int | None, think: bool) -> Answer:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    kwargs: dict[str, Any] = {"reasoning": {"effort": "medium" if think else "none"}}
    if max_tokens is not None:
        kwargs["max_output_tokens"] = max_tokens
    reply = client.responses.create(
        model=MODEL, input=PROMPT, temperature=temperature, store=False, **kwargs
    )
    usage = reply.usage
    assert usage is not None
    return reply.output_text, usage.input_tokens, usage.output_tokens


def _anthropic(server: Server, temperature: float, max_tokens: int | None, think: bool) -> Answer:
    """Anthropic's max_tokens is required: a model's max_tokens default cannot apply."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    thinking: Any = {"type": "enabled", "budget_tokens": 1024} if think else {"type": "disabled"}
    reply = client.messages.create(
        model=MODEL,
        max_tokens=max_tokens or NUM_TOKENS,
        messages=[{"role": "user", "content": PROMPT}],
        thinking=thinking,
        # This SDK no longer names temperature; the Messages API still takes it.
        extra_body={"temperature": temperature},
    )
    text = "".join(block.text for block in reply.content if block.type == "text")
    usage = reply.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    return text, prompt + (usage.cache_creation_input_tokens or 0), usage.output_tokens


def _ollama(server: Server, temperature: float, max_tokens: int | None, think: bool) -> Answer:
    client = ollama.Client(host=server.base_url)
    options: dict[str, Any] = {"temperature": temperature}
    if max_tokens is not None:
        options["num_predict"] = max_tokens
    reply = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        options=options,
        think=think,
    )
    return reply.message.content or "", reply.prompt_eval_count or 0, reply.eval_count or 0


APIS = {
    "openai-chat": _openai_chat,
    "responses": _responses,
    "anthropic": _anthropic,
    "ollama": _ollama,
}


def test_every_api_renders_with_the_models_template_kwargs(server, model_settings) -> None:
    """With the model's enable_thinking: false, every API's prompt has the quiet turn,
    whatever the request's own thinking switch says once the model locks it."""
    loud = {name: ask(server, 0.0, NUM_TOKENS, True) for name, ask in APIS.items()}
    quiet = {name: ask(server, 0.0, NUM_TOKENS, False) for name, ask in APIS.items()}
    for name in APIS:
        assert quiet[name][1] > loud[name][1], name  # the quiet turn is in the prompt
    model_settings(
        {"chat_template_kwargs": {"enable_thinking": False}, "locked_template_kwargs": []}
    )
    # The request's own switch still wins while the model does not lock it ...
    assert {name: ask(server, 0.0, NUM_TOKENS, True) for name, ask in APIS.items()} == loud
    model_settings({"locked_template_kwargs": ["enable_thinking"]})
    # ... and loses once it does: every API renders the quiet prompt, same greedy answer.
    locked = {name: ask(server, 0.0, NUM_TOKENS, True) for name, ask in APIS.items()}
    assert locked == quiet


def test_every_api_takes_the_models_sampling_and_max_tokens(server, model_settings) -> None:
    """A model that forces greedy sampling and sets max_tokens answers a hot request
    that names no budget with its greedy answer of exactly that many tokens."""
    greedy = {name: ask(server, 0.0, NUM_TOKENS, True) for name, ask in APIS.items()}
    texts = {answer[0] for answer in greedy.values()}
    assert len(texts) == 1, greedy  # one prompt, one greedy answer, whatever the API
    hot = [_openai_chat(server, 1.0, NUM_TOKENS, True)[0] for _ in range(3)]
    assert any(text not in texts for text in hot)  # a hot request really samples
    model_settings({"temperature": 0.0, "force_sampling": True, "max_tokens": NUM_TOKENS})
    for name, ask in APIS.items():
        text, _, num_output = ask(server, 1.0, None, True)
        assert (text, num_output) == (greedy[name][0], NUM_TOKENS), name


# ---- the output budget --------------------------------------------------------------

AGENT_BUDGET = 32000  # what Claude Code and opencode send, whatever the model
ROOM = 4  # fewer than the NUM_TOKENS the greedy answer runs to without stopping
# Each API's thinking switch on, as the reference answers were asked (it shapes the prompt).
THINKING: dict[str, dict[str, Any]] = {
    "openai-chat": {"chat_template_kwargs": {"enable_thinking": True}},
    "responses": {"reasoning": {"effort": "medium"}},
    "anthropic": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    "ollama": {"think": True},
}
# Each API, asked for AGENT_BUDGET: (clamp header, text, output tokens, finish reason).
Clamped = tuple[str | None, str, int, str | None]


def _openai_chat_raw(server: Server) -> Clamped:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0.0,
        max_tokens=AGENT_BUDGET,
        extra_body=THINKING["openai-chat"],
    )
    reply = raw.parse()
    assert reply.usage is not None
    choice = reply.choices[0]
    header = raw.headers.get(CLAMPED_HEADER)
    return header, choice.message.content or "", reply.usage.completion_tokens, choice.finish_reason


def _responses_raw(server: Server) -> Clamped:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input=PROMPT,
        temperature=0.0,
        store=False,
        max_output_tokens=AGENT_BUDGET,
        **THINKING["responses"],
    )
    reply = raw.parse()
    assert reply.usage is not None
    reason = reply.incomplete_details.reason if reply.incomplete_details else None
    header = raw.headers.get(CLAMPED_HEADER)
    return header, reply.output_text, reply.usage.output_tokens, reason


def _anthropic_raw(server: Server) -> Clamped:
    """Streamed, as Claude Code asks (the SDK refuses a 32000 budget unstreamed)."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    with client.messages.stream(
        model=MODEL,
        max_tokens=AGENT_BUDGET,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={"temperature": 0.0, **THINKING["anthropic"]},
    ) as stream:
        reply = stream.get_final_message()
        header = stream.response.headers.get(CLAMPED_HEADER)
    text = "".join(block.text for block in reply.content if block.type == "text")
    return header, text, reply.usage.output_tokens, reply.stop_reason


def _ollama_raw(server: Server) -> Clamped:
    """The ollama client shows no headers: the same request through httpx reads it."""
    client = ollama.Client(host=server.base_url)
    options = {"temperature": 0.0, "num_predict": AGENT_BUDGET}
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat(model=MODEL, messages=messages, options=options, think=True)
    body = {"model": MODEL, "messages": messages, "options": options, "stream": False}
    body |= THINKING["ollama"]
    header = httpx.post(server.base_url + "/api/chat", json=body).headers.get(CLAMPED_HEADER)
    return header, reply.message.content or "", reply.eval_count or 0, reply.done_reason


CLAMPED_APIS = {
    "openai-chat": (_openai_chat_raw, "length"),
    "responses": (_responses_raw, "max_output_tokens"),
    # Anthropic's own reason for an answer the context window ended.
    "anthropic": (_anthropic_raw, "model_context_window_exceeded"),
    "ollama": (_ollama_raw, "length"),
}


@pytest.mark.parametrize("api", CLAMPED_APIS)
def test_every_api_clamps_a_budget_larger_than_the_room_left(server, model_settings, api) -> None:
    """A model whose window leaves ROOM tokens after the prompt, asked for 32000: the
    answer is 200 with the first ROOM tokens of the greedy answer, ended as the API
    says a full window ends; the header names the clamp. strict_max_tokens refuses."""
    ask, window_full = CLAMPED_APIS[api]
    text, num_prompt, _ = APIS[api](server, 0.0, NUM_TOKENS, True)
    window = num_prompt + ROOM
    model_settings({"max_context_window": window})
    header, clamped_text, num_output, reason = ask(server)
    assert header == (
        f"requested={AGENT_BUDGET}; granted={ROOM}; prompt_tokens={num_prompt}; "
        f"context_window={window}"
    )
    assert (num_output, reason) == (ROOM, window_full)
    assert clamped_text and text.startswith(clamped_text)
    model_settings({"strict_max_tokens": True})
    refused = _raw_post(server, api)
    assert refused.status_code == 400, refused.text
    assert f"at most {ROOM}" in refused.text and "strict_max_tokens" in refused.text


def _raw_post(server: Server, api: str) -> httpx.Response:
    messages = [{"role": "user", "content": PROMPT}]
    path, body = {
        "openai-chat": ("/v1/chat/completions", {"messages": messages, "max_tokens": AGENT_BUDGET}),
        "responses": ("/v1/responses", {"input": PROMPT, "max_output_tokens": AGENT_BUDGET}),
        "anthropic": ("/v1/messages", {"messages": messages, "max_tokens": AGENT_BUDGET}),
        "ollama": (
            "/api/chat",
            {"messages": messages, "options": {"num_predict": AGENT_BUDGET}, "stream": False},
        ),
    }[api]
    body = {"model": MODEL, **body, **THINKING[api]}
    return httpx.post(server.base_url + path, json=body, timeout=60)
