"""The built-in SmolLM2-135M on two ranks under mlx.launch: its 9 heads do not divide
by 2, so it splits by layers (15 + 15, omlx's llama pipeline); greedy output and
concurrent streams equal the one-process server's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from omlx.models.builtin import BUILTIN_MODEL_NAME
from tests.distributed.conftest import client_for
from tests.distributed.outputs import PROMPTS, concurrent_streams, greedy, with_usage
from tests.distributed.ranks import launched, wait_ready
from tests.fixtures.servers import live_server


@pytest.fixture(scope="module")
def url(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("builtin-split")
    with launched(base, smollm2_path.parent, BUILTIN_MODEL_NAME, "auto") as u:
        yield u


@pytest.fixture(scope="module")
def one_process(
    smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[openai.OpenAI]:
    # The reference answers only: the session's profile of the built-in model serves.
    base = tmp_path_factory.mktemp("builtin-one")
    with live_server(
        base, smollm2_path.parent, profiles=profiles_dir, cache={"enabled": False}
    ) as srv:
        wait_ready(srv.base_url, [], timeout_s=600)  # loaded at start
        yield client_for(srv.base_url)


def test_builtin_model_is_split_by_layers(one_process: openai.OpenAI, url: str) -> None:
    # The one-process reference is up first: its load and profile never race the ranks.
    report = httpx.get(url + "/health").json()["distributed"]
    assert (report["model"], report["parallel"]) == (BUILTIN_MODEL_NAME, "pipeline")


def test_greedy_output_equals_one_process(one_process: openai.OpenAI, url: str) -> None:
    split = client_for(url)
    for prompt in PROMPTS[:2]:
        expected = greedy(one_process, BUILTIN_MODEL_NAME, prompt, 16)
        assert greedy(split, BUILTIN_MODEL_NAME, prompt, 16) == expected
        assert expected  # a real answer, not an empty one


def test_concurrent_streams_equal_one_process(one_process: openai.OpenAI, url: str) -> None:
    # Few tokens: 30 layers in lockstep on two ranks of a shared 2-core box are slow.
    expected = concurrent_streams(one_process, BUILTIN_MODEL_NAME, 8)
    assert concurrent_streams(client_for(url), BUILTIN_MODEL_NAME, 8) == expected


def test_a_repeated_prompt_is_served_from_every_ranks_cache(
    one_process: openai.OpenAI, url: str
) -> None:
    split = client_for(url)
    prompt = "Name the colours in this list: " + ", ".join(["red", "green", "blue"] * 15)
    first, num_prompt, cached = with_usage(split, BUILTIN_MODEL_NAME, prompt, 8)
    again, _, cached_again = with_usage(split, BUILTIN_MODEL_NAME, prompt, 8)
    # At first at most the chat template's opening, which earlier prompts shared.
    assert cached < cached_again == num_prompt - 1
    assert again == first == greedy(one_process, BUILTIN_MODEL_NAME, prompt, 8)
