"""Each token's own text and bytes, as OpenAI's logprobs show them. Pure Python.

A token's bytes come from its vocabulary entry (a byte-level BPE maps each byte
to a printable character; SentencePiece writes spaces as U+2581 and raw bytes
as ``<0xNN>``), so a token holding half a UTF-8 character still has its exact
bytes. Its text is those bytes decoded, with backslash escapes where they are
not whole characters (OpenAI writes such tokens the same way).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from omlx.scheduler import TokenLogprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"
# Tokens whose pieces are remembered (a vocabulary is at most a few 100k).
_MAX_CACHED = 1 << 18


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """A token as the API shows it, with its logprob (None: the first prompt
    token, which nothing predicts) and its best alternatives."""

    token: str
    bytes: bytes
    logprob: float | None
    top: tuple[LogprobEntry, ...] = ()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted (character -> byte)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


def _decoder_kind(tokenizer: Any) -> str:
    """ "byte_level", "metaspace" or "" (anything else: decode the token alone)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        return ""
    try:
        decoder = json.loads(to_str()).get("decoder") or {}
    except (ValueError, TypeError):
        return ""
    text = json.dumps(decoder)
    if '"ByteLevel"' in text:
        return "byte_level"
    if '"Metaspace"' in text or '"ByteFallback"' in text or _SPACE in text:
        return "metaspace"
    return ""


class TokenText:
    """Token id -> (text, bytes), remembered per id; ``tokenizer``: a
    ``tokenizers.Tokenizer`` or a transformers tokenizer."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._kind = _decoder_kind(tokenizer)
        self._pieces: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> tuple[str, bytes]:
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._bytes(token_id)
            piece = (raw.decode("utf-8", errors="backslashreplace"), raw)
            if len(self._pieces) < _MAX_CACHED:
                self._pieces[token_id] = piece
        return piece

    def entry(self, lp: TokenLogprob) -> LogprobEntry:
        top = tuple(self.bare(token_id, value) for token_id, value in lp.top)
        return LogprobEntry(*self.piece(lp.token_id), lp.logprob, top)

    def bare(self, token_id: int, logprob: float | None) -> LogprobEntry:
        return LogprobEntry(*self.piece(token_id), logprob)

    def _bytes(self, token_id: int) -> bytes:
        raw = self._vocab_entry(token_id)
        if raw is not None and self._kind == "byte_level":
            try:
                return bytes(_BYTE_DECODER[c] for c in raw)
            except KeyError:
                pass  # an added token written as itself
            return raw.encode("utf-8")
        if raw is not None and self._kind == "metaspace":
            byte = _BYTE_PIECE.fullmatch(raw)
            return bytes([int(byte.group(1), 16)]) if byte else raw.replace(_SPACE, " ").encode()
        return str(self._tokenizer.decode([token_id])).encode("utf-8")

    def _vocab_entry(self, token_id: int) -> str | None:
        lookup = getattr(self._tokenizer, "id_to_token", None)
        if lookup is None:
            lookup = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        raw = lookup(token_id) if lookup is not None else None
        return raw if isinstance(raw, str) else None
