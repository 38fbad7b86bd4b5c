"""Stored responses (``store: true``): a bounded SQLite file under the base path, so
``previous_response_id``, retrieve and input_items survive a restart.

Each row holds the response object and the input the model was given (earlier
turns + this request's input), which input_items lists and a follow-up continues.
Writes are transactions; the oldest rows go first when the count or byte bound
is passed (the newest row is always kept). Blocking: call through a thread.

Images (``input_image`` data URLs) are stored once, by their SHA-256, in their own
table: a conversation repeats its images in every later turn's row, which would
otherwise store each image once per turn. A row's size counts its text plus every
image it refers to, so the byte bound holds over the file; an image goes with the
last row that refers to it, and a follow-up gets it back in full.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx.errors import InvalidRequestError
from omlx.private_fs import make_private_dir

# The defaults of server.responses_store_max_count / _max_bytes.
DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_BYTES = 512 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    num_bytes INTEGER NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS images (digest TEXT PRIMARY KEY, url TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS response_images (
    seq INTEGER NOT NULL,
    digest TEXT NOT NULL,
    PRIMARY KEY (seq, digest)
);
"""
# What a row's image_url holds in place of the data URL stored in ``images``.
_IMAGE_REF = "omlx-stored-image:sha256:"
# Links of rows gone (evicted, deleted, replaced), then images no row refers to.
_DROP_ORPHANS = (
    "DELETE FROM response_images WHERE seq NOT IN (SELECT seq FROM responses)",
    "DELETE FROM images WHERE digest NOT IN (SELECT digest FROM response_images)",
)
# Rows past the newest ``?`` (count bound), then rows whose running total, newest
# first, passes ``?`` bytes (byte bound); the newest row stays either way.
_EVICT = """
DELETE FROM responses WHERE seq IN (
    SELECT seq FROM (
        SELECT seq,
               ROW_NUMBER() OVER (ORDER BY seq DESC) AS num_newer,
               SUM(num_bytes) OVER (ORDER BY seq DESC) AS total_bytes
        FROM responses
    ) WHERE num_newer > 1 AND (num_newer > ? OR total_bytes > ?)
)
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    # Earlier turns (inputs and outputs) + this request's input; instructions excluded.
    conversation: list[dict[str, Any]]

    @property
    def id(self) -> str:
        return str(self.response["id"])

    def continued(self) -> list[dict[str, Any]]:
        """The items a follow-up (``previous_response_id``) starts from."""
        return [*self.conversation, *self.response["output"]]


def _is_stored_image(node: dict[str, Any]) -> bool:
    url = node.get("image_url")
    return node.get("type") == "input_image" and isinstance(url, str)


def _split_images(node: Any, found: dict[str, str]) -> Any:
    """``node`` with each input_image's data URL replaced by a reference to its digest
    (the URL put in ``found``)."""
    if isinstance(node, list):
        return [_split_images(item, found) for item in node]
    if not isinstance(node, dict):
        return node
    if _is_stored_image(node) and node["image_url"].startswith("data:"):
        digest = hashlib.sha256(node["image_url"].encode()).hexdigest()
        found[digest] = node["image_url"]
        return {**node, "image_url": _IMAGE_REF + digest}
    return {key: _split_images(value, found) for key, value in node.items()}


def _join_images(node: Any, urls: dict[str, str], response_id: str) -> Any:
    """The inverse of ``_split_images``; a reference whose image is gone is a 400."""
    if isinstance(node, list):
        return [_join_images(item, urls, response_id) for item in node]
    if not isinstance(node, dict):
        return node
    if _is_stored_image(node) and node["image_url"].startswith(_IMAGE_REF):
        url = urls.get(node["image_url"].removeprefix(_IMAGE_REF))
        if url is None:
            raise InvalidRequestError(
                f"an image of stored response '{response_id}' is no longer in the store; "
                "send the conversation again with its images instead of previous_response_id",
                param="previous_response_id",
            )
        return {**node, "image_url": url}
    return {key: _join_images(value, urls, response_id) for key, value in node.items()}


class ResponseStore:
    def __init__(
        self,
        path: Path,
        *,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        self.path = path
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # one writer in this process; SQLite locks across
        self._ready = False

    def _connect(self) -> sqlite3.Connection:
        if not self._ready:
            make_private_dir(self.path.parent)
        db = sqlite3.connect(self.path, timeout=30.0)
        if not self._ready:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            self._ready = True
        return db

    def put(self, stored: StoredResponse) -> None:
        images: dict[str, str] = {}
        body = {"response": stored.response, "conversation": stored.conversation}
        data = json.dumps(_split_images(body, images), ensure_ascii=False, separators=(",", ":"))
        num_bytes = len(data.encode()) + sum(len(url) for url in images.values())
        with self._lock, closing(self._connect()) as db, db:
            cursor = db.execute(
                "INSERT OR REPLACE INTO responses (id, num_bytes, data) VALUES (?, ?, ?)",
                (stored.id, num_bytes, data),
            )
            db.executemany("INSERT OR IGNORE INTO images VALUES (?, ?)", images.items())
            db.executemany(
                "INSERT OR IGNORE INTO response_images VALUES (?, ?)",
                [(cursor.lastrowid, digest) for digest in images],
            )
            db.execute(_EVICT, (self.max_responses, self.max_bytes))
            _drop_orphans(db)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response with its images back in full."""
        with self._lock, closing(self._connect()) as db:
            row = db.execute(
                "SELECT seq, data FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
            if row is None:
                return None
            urls = dict(
                db.execute(
                    "SELECT images.digest, url FROM images JOIN response_images "
                    "ON images.digest = response_images.digest WHERE seq = ?",
                    (row[0],),
                ).fetchall()
            )
        data = _join_images(json.loads(row[1]), urls, response_id)
        return StoredResponse(data["response"], data["conversation"])

    def delete(self, response_id: str) -> bool:
        with self._lock, closing(self._connect()) as db, db:
            cursor = db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            _drop_orphans(db)
        return cursor.rowcount > 0

    def image_count(self) -> int:
        """Distinct images held (each once, however many rows refer to it)."""
        with self._lock, closing(self._connect()) as db:
            return int(db.execute("SELECT COUNT(*) FROM images").fetchone()[0])

    def count(self) -> int:
        with self._lock, closing(self._connect()) as db:
            return int(db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])


def _drop_orphans(db: sqlite3.Connection) -> None:
    for statement in _DROP_ORPHANS:
        db.execute(statement)
