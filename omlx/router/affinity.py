"""Prefix affinity (SGLang's cache-aware routing idea): a request goes to the
backend that last served the longest run of its leading prompt blocks, where
that backend's prefix cache most likely still holds them.

The prompt is serialised canonically (the model, then the system text and the
messages, input or prompt in order, each part closed by a separator), cut into
fixed-size blocks, and each block hashed with everything before it, so one hash
names a whole prefix. A conversation that grows keeps its earlier hashes.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

# Fields that make up the prompt, in the order the model sees them, per API.
_PROMPT_FIELDS = (
    "instructions",  # Responses
    "system",  # Anthropic, Ollama generate
    "tools",
    "messages",  # OpenAI chat, Anthropic, Ollama chat
    "input",  # Responses, embeddings
    "prompt",  # completions, Ollama generate
    "suffix",
)
_PART_END = "\x1e"  # record separator: one message (or field) ends here


def _canonical(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_text(body: dict[str, Any]) -> str:
    """The request's prompt as one canonical string (messages one after another)."""
    parts = [f"model={_canonical(body.get('model'))}"]
    for name in _PROMPT_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        items = value if isinstance(value, list) and name in ("messages", "input") else [value]
        parts.extend(f"{name}:{_canonical(item)}" for item in items)
    return _PART_END.join(parts) + _PART_END


def block_hashes(body: dict[str, Any], block_chars: int) -> list[bytes]:
    """Chained hashes of the prompt's blocks, the last (partial) block included:
    hash i names the whole prefix up to the end of block i."""
    data = prompt_text(body).encode("utf-8")
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(data), block_chars):
        previous = hashlib.blake2b(
            previous + data[start : start + block_chars], digest_size=16
        ).digest()
        hashes.append(previous)
    return hashes


class AffinityTable:
    """Block hash -> the backend URL that last served it; bounded, least
    recently used forgotten first."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def lookup(self, hashes: list[bytes]) -> tuple[str, int] | None:
        """(backend, number of leading blocks it served) for the longest known
        prefix, or None when no block is known."""
        for index in range(len(hashes) - 1, -1, -1):
            owner = self._owner.get(hashes[index])
            if owner is not None:
                return owner, index + 1
        return None

    def record(self, hashes: list[bytes], backend: str) -> None:
        for digest in hashes:
            self._owner[digest] = backend
            self._owner.move_to_end(digest)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget_backend(self, backend: str) -> int:
        """Drop a backend's entries (its cache is gone, e.g. after a release)."""
        stale = [h for h, owner in self._owner.items() if owner == backend]
        for digest in stale:
            del self._owner[digest]
        return len(stale)
