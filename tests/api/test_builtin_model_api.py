"""The built-in SmolLM2 through the OpenAI client: real weights, real answers."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from omlx.api.output_budget import CLAMPED_HEADER
from tests.fixtures.servers import live_server

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(
    smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator:
    with live_server(
        tmp_path_factory.mktemp("base"),
        smollm2_path.parent,
        # The settings of test_structured_builtin.py's and test_tool_grammar.py's servers:
        # SmolLM2's auto-profile, measured here, is reused there (profiles_dir).
        scheduler={"max_concurrent_requests": 8},
        profiles=profiles_dir,
    ) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def ask(client: openai.OpenAI, question: str, stream: bool = False) -> str:
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 24,
    }
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_built_in_model_is_listed_and_answers_paris(client: openai.OpenAI) -> None:
    assert MODEL in {m.id for m in client.models.list()}
    answer = ask(client, QUESTIONS[0])
    assert "Paris" in answer
    assert ask(client, QUESTIONS[0], stream=True) == answer


def test_concurrent_greedy_answers_equal_solo_answers(client: openai.OpenAI) -> None:
    solo = [ask(client, q) for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(client, q, stream=True), QUESTIONS))
    assert together == solo


def test_an_agents_32000_token_budget_is_served_clamped_to_the_8k_window(
    client: openai.OpenAI,
) -> None:
    """Claude Code and opencode send max_tokens 32000 whatever the model: the built-in
    model's 8k window answers (200) with the budget clamped to what the prompt leaves."""
    import anthropic

    claude = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x")
    with claude.messages.stream(
        model=MODEL,
        max_tokens=32000,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        extra_body={"temperature": 0},
    ) as stream:
        assert stream.response.status_code == 200
        clamp = dict(p.split("=") for p in stream.response.headers[CLAMPED_HEADER].split("; "))
        reply = stream.get_final_message()
    assert clamp["requested"] == "32000" and clamp["context_window"] == "8192"
    prompt = reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    assert int(clamp["granted"]) == 8192 - prompt
    assert "Paris" in "".join(b.text for b in reply.content if b.type == "text")
