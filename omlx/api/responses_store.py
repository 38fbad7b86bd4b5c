"""Stored responses (``store: true``): a bounded SQLite file under the base path, so
``previous_response_id``, retrieve and input_items survive a restart.

Each row holds the response object and the input the model was given (earlier
turns + this request's input), which input_items lists and a follow-up continues.
Writes are transactions; the oldest rows go first when the count or byte bound
is passed (the newest row is always kept). Blocking: call through a thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
)
"""
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
            db.execute(_SCHEMA)
            self._ready = True
        return db

    def put(self, stored: StoredResponse) -> None:
        data = json.dumps(
            {"response": stored.response, "conversation": stored.conversation},
            ensure_ascii=False,
            separators=(",", ":"),
        )
        with self._lock, closing(self._connect()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO responses (id, num_bytes, data) VALUES (?, ?, ?)",
                (stored.id, len(data.encode()), data),
            )
            db.execute(_EVICT, (self.max_responses, self.max_bytes))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock, closing(self._connect()) as db:
            row = db.execute("SELECT data FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            return None
        data = json.loads(row[0])
        return StoredResponse(data["response"], data["conversation"])

    def delete(self, response_id: str) -> bool:
        with self._lock, closing(self._connect()) as db, db:
            cursor = db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cursor.rowcount > 0

    def count(self) -> int:
        with self._lock, closing(self._connect()) as db:
            return int(db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])
