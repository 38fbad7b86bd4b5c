from __future__ import annotations

import subprocess
import sys

import pytest

from omlx.cache.blocks import BlockPool, KVCacheManager, PrefixMatch, block_keys

BS = 4
MODEL = "org/model-4bit"


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(MODEL, num_blocks=8, block_size=BS)


def run(manager: KVCacheManager, request_id: str, prompt: list[int]) -> PrefixMatch:
    """Prefill a request fully and publish its blocks, as the scheduler would."""
    match = manager.match(request_id, prompt)
    assert manager.allocate_slots(request_id, len(prompt) - match.num_cached_tokens) is not None
    manager.commit(request_id, prompt)
    return match


# --- keys ---


def test_keys_one_per_full_block_only() -> None:
    assert len(block_keys(MODEL, list(range(11)), BS)) == 2
    assert len(block_keys(MODEL, list(range(12)), BS)) == 3
    assert block_keys(MODEL, [1, 2, 3], BS) == []


def test_same_inputs_same_keys() -> None:
    tokens = list(range(8))
    assert block_keys(MODEL, tokens, BS, ("lora-a",)) == block_keys(MODEL, tokens, BS, ("lora-a",))
    assert all(len(key) == 32 for key in block_keys(MODEL, tokens, BS))


def test_key_depends_on_parent_model_and_extras() -> None:
    base = block_keys(MODEL, [1, 2, 3, 4, 5, 6, 7, 8], BS)
    other_parent = block_keys(MODEL, [9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert base[1] != other_parent[1]  # same tokens in block 1, different parent
    assert block_keys("other/model", [1, 2, 3, 4], BS)[0] != base[0]
    assert block_keys(MODEL, [1, 2, 3, 4], BS, ("lora-a",))[0] != base[0]
    assert (
        block_keys(MODEL, [1, 2, 3, 4], BS, ("a", "b"))[0]
        != block_keys(MODEL, [1, 2, 3, 4], BS, ("ab",))[0]
    )


def test_keys_stable_across_processes() -> None:
    code = (
        "from omlx.cache.blocks import block_keys;"
        f"print(','.join(k.hex() for k in block_keys({MODEL!r}, list(range(8)), {BS}, ('x',))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PYTHONPATH": "."},
    ).stdout.strip()
    assert out == ",".join(k.hex() for k in block_keys(MODEL, list(range(8)), BS, ("x",)))


# --- pool ---


def test_pool_lookup_stops_at_first_miss() -> None:
    pool = BlockPool(4)
    keys = block_keys(MODEL, list(range(12)), BS)
    ids = pool.allocate(3)
    pool.register(ids[0], keys[0])
    pool.register(ids[2], keys[2])
    assert pool.lookup(keys) == [ids[0]]


def test_pool_double_free_raises() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids)


def test_pool_allocate_beyond_capacity_raises() -> None:
    pool = BlockPool(2)
    assert not pool.can_allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_pool_evicts_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    keys = block_keys(MODEL, list(range(12)), BS)
    ids = pool.allocate(3)
    for block_id, key in zip(ids, keys, strict=True):
        pool.register(block_id, key)
    pool.free([ids[1]])
    pool.free([ids[0]])
    pool.free([ids[2]])
    assert pool.allocate(1) == [ids[1]]
    assert pool.num_evictions == 1
    assert pool.lookup(keys[1:2]) == []
    assert pool.lookup(keys[:1]) == [ids[0]]


def test_pool_duplicate_key_keeps_one_copy() -> None:
    pool = BlockPool(2)
    key = block_keys(MODEL, [1, 2, 3, 4], BS)[0]
    first, second = pool.allocate(2)
    assert pool.register(first, key)
    assert not pool.register(second, key)
    pool.free([second])
    pool.allocate(1)
    assert pool.num_evictions == 0
    assert pool.lookup([key]) == [first]


# --- manager ---


def test_cold_match_misses(manager: KVCacheManager) -> None:
    match = manager.match("a", list(range(10)))
    assert match == PrefixMatch(0, ())
    assert (manager.num_hits, manager.num_misses) == (0, 2)


def test_exact_repeat_hits_all_full_blocks(manager: KVCacheManager) -> None:
    prompt = list(range(10))
    run(manager, "a", prompt)
    manager.free("a")
    again = manager.match("b", prompt)
    assert again.num_cached_tokens == 8
    assert len(again.block_ids) == 2
    assert manager.num_cached_tokens_served == 8


def test_exact_repeat_reuses_the_same_blocks(manager: KVCacheManager) -> None:
    prompt = list(range(10))
    run(manager, "a", prompt)
    table = manager.block_table("a")
    manager.free("a")
    again = manager.match("b", prompt)
    assert again.block_ids == tuple(table[:2])


def test_whole_prompt_cached_leaves_one_token(manager: KVCacheManager) -> None:
    prompt = list(range(12))  # exactly three full blocks
    run(manager, "a", prompt)
    manager.free("a")
    match = manager.match("b", prompt)
    assert match.num_cached_tokens == 8
    assert len(prompt) - match.num_cached_tokens >= 1


def test_short_prompts_never_over_report(manager: KVCacheManager) -> None:
    run(manager, "a", [1, 2, 3, 4])
    assert manager.match("b", [1, 2, 3, 4]).num_cached_tokens == 0
    assert manager.match("c", []).num_cached_tokens == 0


def test_mid_sequence_change_invalidates_later_blocks(manager: KVCacheManager) -> None:
    prompt = list(range(16))
    run(manager, "a", prompt)
    changed = [*prompt[:5], 99, *prompt[6:]]  # block 1 differs, blocks 2-3 identical
    assert manager.match("b", changed).num_cached_tokens == 4


def test_conversation_turn_hits_previous_full_blocks(manager: KVCacheManager) -> None:
    turn1 = list(range(10))
    manager.match("t1", turn1)
    manager.allocate_slots("t1", len(turn1))
    answer = [50, 51, 52, 53, 54]
    for _ in answer:  # decode: one slot per generated token
        manager.allocate_slots("t1", 1)
    manager.commit("t1", turn1 + answer)
    manager.free("t1")
    turn2 = [*turn1, *answer, 70, 71, 72]  # 18 tokens
    match = manager.match("t2", turn2)
    assert match.num_cached_tokens == 12  # every full block of the 15-token history
    assert manager.num_hits == 3


def test_extra_keys_separate_cache_entries(manager: KVCacheManager) -> None:
    prompt = list(range(10))
    manager.match("a", prompt, ("lora-a",))
    manager.allocate_slots("a", 10)
    manager.commit("a", prompt)
    assert manager.match("b", prompt, ("lora-b",)).num_cached_tokens == 0
    assert manager.match("c", prompt, ("lora-a",)).num_cached_tokens == 8


def test_shared_blocks_survive_freeing_one_request(manager: KVCacheManager) -> None:
    prompt = list(range(10))
    run(manager, "a", prompt)
    match = run(manager, "b", prompt)
    shared = match.block_ids
    assert all(manager.pool.blocks[b].ref_count == 2 for b in shared)
    manager.free("a")
    assert all(manager.pool.blocks[b].ref_count == 1 for b in shared)
    # Filling the rest of the pool must not evict blocks still held by "b".
    assert manager.match("c", [7] * 5) == PrefixMatch(0, ())
    while manager.allocate_slots("c", BS) is not None:
        pass
    assert manager.match("d", prompt).block_ids == shared


def test_commit_only_keys_full_blocks_with_slots(manager: KVCacheManager) -> None:
    prompt = list(range(12))
    manager.match("a", prompt)
    manager.allocate_slots("a", 6)  # chunked prefill: only 6 tokens computed
    manager.commit("a", prompt)
    assert manager.match("b", prompt).num_cached_tokens == 4


def test_duplicate_commit_keeps_one_copy(manager: KVCacheManager) -> None:
    prompt = list(range(10))
    for request_id in ("a", "b"):  # both prefill before either commits
        manager.match(request_id, prompt)
        manager.allocate_slots(request_id, 10)
    manager.commit("a", prompt)
    manager.commit("b", prompt)
    manager.free("a")
    manager.free("b")
    assert manager.match("c", prompt).block_ids == tuple(
        manager.pool.lookup(block_keys(MODEL, prompt, BS))
    )
    manager.free("c")
    # Reusing every slot evicts only the two keyed blocks, not the duplicates.
    manager.match("d", [])
    assert manager.allocate_slots("d", 8 * BS) is not None
    assert manager.num_evictions == 2


def test_freed_blocks_evicted_lru_and_dropped_from_index() -> None:
    manager = KVCacheManager(MODEL, num_blocks=4, block_size=BS)
    old = list(range(9))  # 3 blocks, 2 full and keyed
    run(manager, "old", old)
    manager.free("old")
    # Needs 3 blocks: the never-used one, then old's tail first (freed in reverse).
    run(manager, "new", [100 + t for t in range(9)])
    assert manager.num_evictions == 1
    manager.free("new")
    assert manager.match("again", old).num_cached_tokens == 4


def test_allocate_slots_returns_none_when_full_and_leaks_nothing(
    manager: KVCacheManager,
) -> None:
    assert manager.num_free_blocks == 8
    run(manager, "a", list(range(20)))  # 5 blocks
    manager.match("b", [1] * 20)
    assert manager.allocate_slots("b", 20) is None
    assert manager.block_table("b") == []
    assert manager.allocate_slots("b", 12) is not None
    assert manager.num_used_blocks == 8
    assert manager.usage == 1.0
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == 8
    assert manager.usage == 0.0


def test_allocate_slots_grows_block_table(manager: KVCacheManager) -> None:
    manager.match("a", [])
    assert len(manager.allocate_slots("a", 5) or []) == 2
    assert manager.allocate_slots("a", 3) == []
    assert len(manager.allocate_slots("a", 1) or []) == 1
    assert len(manager.block_table("a")) == 3
    assert [manager.pool.blocks[b].num_tokens for b in manager.block_table("a")] == [4, 4, 1]


def test_request_double_free_raises(manager: KVCacheManager) -> None:
    run(manager, "a", list(range(6)))
    manager.free("a")
    with pytest.raises(ValueError, match="double free"):
        manager.free("a")


def test_match_twice_for_same_request_raises(manager: KVCacheManager) -> None:
    manager.match("a", [1, 2, 3])
    with pytest.raises(ValueError):
        manager.match("a", [1, 2, 3])


def test_counters_accumulate(manager: KVCacheManager) -> None:
    prompt = list(range(13))  # 3 candidate blocks
    run(manager, "a", prompt)
    run(manager, "b", prompt)
    run(manager, "c", [*prompt[:4], 0, *prompt[5:]])
    assert manager.num_hits == 3 + 1
    assert manager.num_misses == 3 + 0 + 2
    assert manager.num_cached_tokens_served == (3 + 1) * BS
