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


def with_image(response_id: str, url: str, earlier: list[dict] | None = None) -> StoredResponse:
    """A turn whose user message carries ``url`` as an input_image, after ``earlier``."""
    content = [{"type": "input_text", "text": "what is this"},
               {"type": "input_image", "image_url": url, "detail": "auto"}]  # fmt: skip
    user = {"id": f"in_{response_id}", "type": "message", "role": "user", "content": content}
    reply = {"id": f"msg_{response_id}", "type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "a cat"}]}  # fmt: skip
    return StoredResponse({"id": response_id, "output": [reply]}, [*(earlier or []), user])


def data_url(fill: str, size: int) -> str:
    return "data:image/png;base64," + fill * size


def test_an_image_repeated_in_every_turn_is_stored_once_and_comes_back_whole(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r.db"
    store = ResponseStore(path)
    image = data_url("A", 200_000)
    turn = with_image("t0", image)
    store.put(turn)
    for i in range(1, 6):  # each follow-up's conversation holds every earlier turn
        turn = with_image(f"t{i}", image, turn.continued())
        store.put(turn)
    assert store.image_count() == 1
    # Six rows referring to one 200 kB image; the file holds it once, not 21 times.
    assert sum(f.stat().st_size for f in tmp_path.glob("r.db*")) < 1_500_000
    got = ResponseStore(path).get("t5")
    assert got == turn  # a follow-up continues with the image in full
    images = [p for item in got.conversation if isinstance(item["content"], list)
              for p in item["content"] if p["type"] == "input_image"]  # fmt: skip
    assert len(images) == 6 and all(p["image_url"] == image for p in images)


def test_image_bytes_count_against_the_byte_bound(tmp_path: Path) -> None:
    # Each row refers to its own 400 kB image: two fit in 1 MB, the third pushes one out.
    store = ResponseStore(tmp_path / "r.db", max_bytes=1_000_000)
    for name, fill in zip("abc", "ABC", strict=True):
        store.put(with_image(name, data_url(fill, 400_000)))
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert store.image_count() == 2  # the evicted row's image went with it


def test_an_image_goes_with_the_last_row_that_refers_to_it(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.db")
    shared, other = data_url("S", 1000), data_url("O", 1000)
    store.put(with_image("a", shared))
    store.put(with_image("b", shared))
    store.put(with_image("c", other))
    assert store.image_count() == 2
    assert store.delete("a") and store.image_count() == 2  # "b" still refers to it
    assert store.get("b") == with_image("b", shared)
    assert store.delete("b") and store.image_count() == 1
    store.put(with_image("c", shared))  # replacing a row drops what it referred to
    assert store.image_count() == 1 and store.get("c") == with_image("c", shared)
