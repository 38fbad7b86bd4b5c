"""Stored Responses API responses live on the backend that made them: remember
which one (the id is read from the answer as it passes), so a follow-up with
``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}`` go there."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import AsyncIterator

# The id comes first in a JSON answer, and in the first SSE event (response.created).
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,100})"')
SNIFF_BYTES = 16 * 1024


class ResponseOwners:
    """Response id -> backend URL; bounded, least recently used forgotten first."""

    def __init__(self, max_entries: int = 100_000):
        self.max_entries = max_entries
        self._owner: OrderedDict[str, str] = OrderedDict()

    def get(self, response_id: object) -> str | None:
        if not isinstance(response_id, str):
            return None
        owner = self._owner.get(response_id)
        if owner is not None:
            self._owner.move_to_end(response_id)
        return owner

    def record(self, response_id: str, backend: str) -> None:
        self._owner[response_id] = backend
        self._owner.move_to_end(response_id)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)


async def noting_response_id(
    chunks: AsyncIterator[bytes], owners: ResponseOwners, backend: str
) -> AsyncIterator[bytes]:
    """Pass ``chunks`` through untouched, noting the first response id seen in
    the first SNIFF_BYTES."""
    head = b""
    async for chunk in chunks:
        if len(head) < SNIFF_BYTES:
            head += chunk
            found = _RESPONSE_ID.search(head)
            if found is not None:
                owners.record(found.group(1).decode(), backend)
                head = b"x" * SNIFF_BYTES  # found: stop looking
        yield chunk
