"""The stored-responses file: bounds with oldest-first eviction, no lost writes under
concurrency, and the data still there for a new store on the same file."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omlx.api.responses_store import ResponseStore, StoredResponse


def stored(response_id: str, text: str = "hi") -> StoredResponse:
    message = {"id": f"msg_{response_id}", "type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": text}]}  # fmt: skip
    user = {"id": f"in_{response_id}", "type": "message", "role": "user", "content": text}
    return StoredResponse({"id": response_id, "output": [message]}, [user])


def test_put_get_delete_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "responses.db"
    store = ResponseStore(path)
    store.put(stored("a", "first"))
    got = store.get("a")
    assert got == stored("a", "first")
    assert got.continued() == [*got.conversation, *got.response["output"]]
    assert ResponseStore(path).get("a") == got  # a restart reads the same file
    assert store.delete("a") and store.get("a") is None
    assert not store.delete("a")
    assert path.parent.stat().st_mode & 0o077 == 0  # conversations are private


def test_count_bound_evicts_the_oldest(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.db", max_responses=3)
    for name in "abcde":
        store.put(stored(name))
    assert store.count() == 3
    assert [store.get(n) is not None for n in "abcde"] == [False, False, True, True, True]


def test_byte_bound_evicts_the_oldest_but_keeps_the_newest(tmp_path: Path) -> None:
    # A row holds the text twice (input and output): ~2.2 kB; three fit in 7000 bytes.
    store = ResponseStore(tmp_path / "r.db", max_bytes=7000)
    for name in "abcd":
        store.put(stored(name, "x" * 1000))
    assert store.get("a") is None and store.get("d") is not None
    assert store.count() == 3
    store.put(stored("huge", "y" * 10_000))  # over the bound alone: kept, others go
    assert store.count() == 1 and store.get("huge") is not None


def test_concurrent_writes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    stores = [ResponseStore(path), ResponseStore(path)]  # two stores: SQLite's own locking too

    def write(i: int) -> None:
        stores[i % 2].put(stored(f"r{i}", f"text {i}"))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(200)))
    assert stores[0].count() == 200
    assert all(stores[1].get(f"r{i}") == stored(f"r{i}", f"text {i}") for i in range(200))
