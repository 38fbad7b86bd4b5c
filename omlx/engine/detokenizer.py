"""Incremental detokenization and stop-string matching.

``IncrementalDetokenizer`` decodes a small sliding window of token ids and
emits only text that is complete: a window whose decode ends in U+FFFD (half a
UTF-8 character) is held back until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded as left context so the first generated token keeps its
# leading space (SentencePiece decoders strip it at the start of a decode).
_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        # Not an image placeholder's negative id (mlx-vlm's -200): no tokenizer spells it.
        self._ids = [t for t in prompt_ids[-_CONTEXT_TOKENS:] if t >= 0]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""


class StopStringMatcher:
    """Finds stop strings across token boundaries.

    Text that could be the start of a stop string is held back until it is
    either completed (stop: the stop string and anything after it is dropped)
    or ruled out.
    """

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string hit or None). When several
        match, the one that starts first wins (the longest on a tie)."""
        if not self._stops:
            return text, None
        held = len(self._held)
        buf = self._held + text
        # The held text holds no whole stop (it would have matched), so a match
        # ends in the new text: start looking where that is possible.
        hits = [
            (i, -len(s), s)
            for s in self._stops
            if (i := buf.find(s, max(held - len(s) + 1, 0))) >= 0
        ]
        if hits:
            self._held = ""
            start, _, stop = min(hits)
            return buf[:start], stop
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that starts some stop string."""
        best = 0
        for stop in self._stops:
            # Candidates: where the stop's first character occurs, in the last
            # len(stop) - 1 characters, giving a suffix longer than ``best``.
            start, end = max(len(buf) - len(stop) + 1, 0), len(buf) - best
            i = buf.find(stop[0], start, end)
            while i >= 0:
                if stop.startswith(buf[i:]):
                    best = len(buf) - i
                    break
                i = buf.find(stop[0], i + 1, end)
        return best
