"""Two ranks, tensor parallel (llama's `shard`), under mlx.launch on loopback: the
split server answers exactly as one process does, and refuses what it cannot split."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.distributed.conftest import PP_MODEL, TP_MODEL, client_for, half_the_kv_of
from tests.distributed.outputs import PROMPTS, concurrent_streams, greedy, seeded
from tests.distributed.ranks import launched


@pytest.fixture(scope="module")
def url(split_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with launched(tmp_path_factory.mktemp("tp"), split_models_dir, TP_MODEL, "tensor") as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return client_for(url)


def test_each_rank_guards_the_kv_of_its_own_heads(url: str, split_models_dir: Path) -> None:
    report = httpx.get(url + "/health").json()["distributed"]
    assert report["parallel"] == "tensor"
    assert report["kv_bytes_per_token_per_rank"] == half_the_kv_of(split_models_dir, TP_MODEL)


def test_greedy_output_equals_one_process(client, single_client) -> None:
    for prompt in PROMPTS:
        assert greedy(client, TP_MODEL, prompt) == greedy(single_client, TP_MODEL, prompt)


def test_concurrent_streams_equal_one_process(client, single_client) -> None:
    split = concurrent_streams(client, TP_MODEL)
    assert split == concurrent_streams(single_client, TP_MODEL)
    assert all(split)


def test_seeded_sampling_equals_one_process(client, single_client) -> None:
    assert seeded(client, TP_MODEL) == seeded(single_client, TP_MODEL)


def test_health_and_admin_list_both_ranks_with_memory(url: str) -> None:
    health = httpx.get(url + "/health").json()
    report = health["distributed"]
    assert report["healthy"] is True
    assert report["parallel"] == "tensor" and report["world_size"] == 2
    assert [r["state"] for r in report["ranks"]] == ["serving", "following"]
    admin = httpx.get(url + "/admin/api/cluster").json()["distributed"]
    for rank in admin["ranks"]:
        assert rank["memory"]["resident_bytes"] > 0
        assert rank["memory"]["limit_bytes"] > 0


def test_only_the_split_model_is_served(client) -> None:
    assert [m.id for m in client.models.list()] == [TP_MODEL]
    with pytest.raises(openai.NotFoundError):
        greedy(client, PP_MODEL, "hi", max_tokens=2)


def test_structured_output_is_refused_clearly(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=TP_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        )
    assert "split across ranks" in info.value.message


def test_a_request_after_a_refusal_still_runs(client, single_client) -> None:
    """A refused request leaves nothing behind on any rank."""
    assert greedy(client, TP_MODEL, PROMPTS[1], 8) == greedy(single_client, TP_MODEL, PROMPTS[1], 8)
