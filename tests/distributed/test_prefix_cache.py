"""The prefix cache of a model split across ranks (two ranks, tensor parallel, under
mlx.launch on loopback): each rank keeps its own KV shard in its own SSD folder under
the same block keys; a repeated prompt is served from every rank's cache, and a rank
that lost blocks shrinks the hit to what all ranks hold, never changes the answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.distributed.conftest import TP_MODEL, client_for
from tests.distributed.outputs import greedy, with_usage
from tests.distributed.ranks import launched, ranks_by_hand

BLOCK = 16
# Every block lives on the SSD alone (a RAM tier of 1 byte), so deleting one rank's
# files takes its blocks away from that rank only.
SSD_ONLY = {"OMLX_CACHE__BLOCK_SIZE": str(BLOCK), "OMLX_CACHE__HOT_CACHE_MAX_SIZE": "1"}
LONG_A = "Summarise this list: " + ", ".join(f"apple {i}" for i in range(40))
LONG_B = "Count these please: " + ", ".join(f"pear {i} plum" for i in range(40))
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(
    split_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[openai.OpenAI, Path, str]]:
    base = tmp_path_factory.mktemp("tp-cache")
    with launched(base, split_models_dir, TP_MODEL, "tensor", env=SSD_ONLY) as url:
        yield client_for(url), base / "cache" / "omlx-kv-v1", url


def ask(client: openai.OpenAI, prompt: str) -> tuple[str, int, int]:
    return with_usage(client, TP_MODEL, prompt, MAX_TOKENS)


def rank_blocks(root: Path, rank: int) -> dict[str, Path]:
    """A rank's block files by name (its own folder: ranks on one host share none)."""
    (folder,) = root.glob(f"*-tensor-rank{rank}-of-2")
    return {p.name: p for p in folder.glob("*.safetensors")}


def settled(root: Path) -> set[str]:
    """The block files once both ranks wrote the same ones (the SSD writes are async)."""
    deadline, last = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        names = [set(rank_blocks(root, rank)) for rank in (0, 1)]
        if names[0] and names[0] == names[1] == last:
            return last
        last = names[0] if names[0] == names[1] else None
        time.sleep(0.5)
    raise AssertionError(f"the ranks' caches differ: {names}")


def test_a_repeated_prompt_is_served_from_every_ranks_cache(cluster, single_client) -> None:
    client, root, url = cluster
    first, num_prompt, cached = ask(client, LONG_A)
    assert cached == 0 and num_prompt > 4 * BLOCK
    settled(root)  # both ranks hold the prompt's blocks, under the same keys
    again, num_again, cached_again = ask(client, LONG_A)
    # Every prompt token but the last (its forward gives the first output token).
    assert (num_again, cached_again) == (num_prompt, num_prompt - 1)
    assert again == first == greedy(single_client, TP_MODEL, LONG_A, MAX_TOKENS)
    # /health shows each rank's own cache: both stored the blocks and served the hit.
    for rank in httpx.get(url + "/health").json()["distributed"]["ranks"]:
        assert rank["cache"]["hits"] >= 1 and rank["cache"]["blocks_stored"] >= 4, rank


def test_a_rank_that_lost_blocks_shrinks_the_hit_not_the_answer(cluster, single_client) -> None:
    client, root, _ = cluster
    before = settled(root)
    first, num_prompt, _ = ask(client, LONG_B)
    new = sorted(
        set(settled(root)) - before, key=lambda n: rank_blocks(root, 1)[n].stat().st_mtime_ns
    )
    assert len(new) > 3
    # Rank 1 keeps the first block it wrote for this prompt; rank 0 keeps them all.
    for name in new[1:]:
        rank_blocks(root, 1)[name].unlink()
    again, _, cached = ask(client, LONG_B)
    assert again == first == greedy(single_client, TP_MODEL, LONG_B, MAX_TOKENS)
    # Rank 1's whole blocks up to its first missing one: less than rank 0 holds.
    assert BLOCK <= cached < num_prompt - 1 and cached % BLOCK == 0


def test_clearing_the_cache_clears_every_ranks_tiers(cluster) -> None:
    """The admin panel's clear reaches every rank: no rank keeps blocks (or files on
    its own disk) after it, and the prompt is no longer served from any cache."""
    client, root, url = cluster
    ask(client, LONG_A)
    assert rank_blocks(root, 0) and rank_blocks(root, 1)  # (the last test took some of 1's)
    cleared = httpx.post(url + "/admin/api/cache/clear", json={"tier": "both"}, timeout=60)
    assert cleared.status_code == 200, cleared.text
    assert rank_blocks(root, 0) == {} and rank_blocks(root, 1) == {}
    _, _, cached = ask(client, LONG_A)
    assert cached == 0


def test_a_rank_keeping_no_cache_still_takes_part(
    split_models_dir: Path, tmp_path: Path, single_client
) -> None:
    """Rank 1's settings switch its cache off: nothing is served from any rank's cache,
    and no rank waits for another's lookup."""
    off = {1: {"OMLX_CACHE__ENABLED": "false"}}
    with ranks_by_hand(tmp_path, split_models_dir, TP_MODEL, "tensor", env=off) as (url, _):
        client = client_for(url)
        first, _, _ = with_usage(client, TP_MODEL, LONG_A, MAX_TOKENS)
        again, _, cached = with_usage(client, TP_MODEL, LONG_A, MAX_TOKENS)
    assert cached == 0
    assert again == first == greedy(single_client, TP_MODEL, LONG_A, MAX_TOKENS)
