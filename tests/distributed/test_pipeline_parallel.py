"""Two ranks, pipeline parallel (qwen2's `pipeline`: rank 1 runs the first layers,
rank 0 the last), under mlx.launch on loopback: the same answers as one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.distributed.conftest import PP_MODEL, client_for, half_the_kv_of
from tests.distributed.outputs import PROMPTS, concurrent_streams, greedy, seeded
from tests.distributed.ranks import launched


@pytest.fixture(scope="module")
def url(split_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with launched(tmp_path_factory.mktemp("pp"), split_models_dir, PP_MODEL, "pipeline") as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return client_for(url)


def test_the_model_is_split_by_layers(url: str, split_models_dir: Path) -> None:
    report = httpx.get(url + "/health").json()["distributed"]
    assert report["parallel"] == "pipeline" and report["healthy"] is True
    # Each rank's guard prices the KV of its own layers, not the whole model's.
    assert report["kv_bytes_per_token_per_rank"] == half_the_kv_of(split_models_dir, PP_MODEL)


def test_greedy_output_equals_one_process(client, single_client) -> None:
    for prompt in PROMPTS:
        assert greedy(client, PP_MODEL, prompt) == greedy(single_client, PP_MODEL, prompt)


def test_concurrent_streams_equal_one_process(client, single_client) -> None:
    split = concurrent_streams(client, PP_MODEL)
    assert split == concurrent_streams(single_client, PP_MODEL)
    assert all(split)


def test_seeded_sampling_equals_one_process(client, single_client) -> None:
    assert seeded(client, PP_MODEL) == seeded(single_client, PP_MODEL)
