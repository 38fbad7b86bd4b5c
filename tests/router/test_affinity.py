"""Prompt block hashes and the affinity table (pure)."""

from __future__ import annotations

from omlx.router.affinity import AffinityTable, block_hashes, prompt_text

BLOCK = 64


def chat(*contents: str, model: str = "m") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": c} for c in contents]}


def test_a_grown_conversation_keeps_its_leading_hashes() -> None:
    first = block_hashes(chat("x" * 300), BLOCK)
    grown = block_hashes(chat("x" * 300, "a follow-up question"), BLOCK)
    full_blocks = len("x" * 300) // BLOCK
    assert grown[:full_blocks] == first[:full_blocks]
    assert len(grown) > len(first)


def test_model_and_sampling_fields() -> None:
    base = block_hashes(chat("hello"), BLOCK)
    assert block_hashes(chat("hello", model="other"), BLOCK)[0] != base[0]
    sampled = {**chat("hello"), "temperature": 0.3, "max_tokens": 9, "stream": True}
    assert block_hashes(sampled, BLOCK) == base  # not part of the prompt


def test_each_api_shape_hashes_its_prompt() -> None:
    for body, text in (
        ({"model": "m", "prompt": "p" * 100}, "p" * 100),
        ({"model": "m", "input": "i" * 100, "instructions": "be brief"}, "i" * 100),
        ({"model": "m", "system": "s" * 100, "messages": []}, "s" * 100),
    ):
        assert text in prompt_text(body)
        assert len(block_hashes(body, BLOCK)) >= 2
        assert block_hashes(body, BLOCK) != block_hashes({**body, "model": "n"}, BLOCK)


def test_lookup_finds_the_longest_known_prefix() -> None:
    table = AffinityTable(max_entries=100)
    short = block_hashes(chat("y" * 200), BLOCK)
    longer = block_hashes(chat("y" * 200, "z" * 200), BLOCK)
    table.record(short, "http://a")
    assert table.lookup(longer) == ("http://a", len(short) - 1)  # shared full blocks
    table.record(longer, "http://b")
    assert table.lookup(longer) == ("http://b", len(longer))
    assert table.lookup(block_hashes(chat("unrelated"), BLOCK)) is None


def test_table_is_bounded_and_forgets_a_backend() -> None:
    table = AffinityTable(max_entries=5)
    old = block_hashes(chat("o" * 200), BLOCK)
    table.record(old, "http://a")
    table.record(block_hashes(chat("n" * 400), BLOCK), "http://b")
    assert len(table) == 5
    assert table.lookup(old) is None  # least recently used went first
    assert table.forget_backend("http://b") == 5
    assert len(table) == 0
