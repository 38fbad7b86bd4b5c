"""Request inputs -> token sequences, with the bounds of one request (pure: no MLX).

Runs on the event loop. Text is tokenized with the model's own tokenizer
(special tokens added, as sentence-transformers does); token-id inputs are
used as given. An input longer than the model's position table is a 400,
unless the request asks to truncate (``"truncate": true``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omlx.errors import InvalidRequestError

# OpenAI's own cap on inputs per request; documents per rerank request too.
MAX_INPUTS_PER_REQUEST = 2048
# Tokens over all inputs of one request: a few seconds of CPU work at most for a
# MiniLM (benchmarks/README.md, "Figures behind design choices").
MAX_TOKENS_PER_REQUEST = 131072


@dataclass(frozen=True, slots=True)
class Sequence:
    ids: list[int]
    type_ids: list[int]


def _fit(ids: list[int], types: list[int], specials: list[int], limit: int) -> Sequence:
    """Cut to ``limit`` tokens, keeping a closing special token ([SEP], EOS) last."""
    if len(ids) <= limit:
        return Sequence(ids, types)
    if specials and specials[-1]:
        return Sequence(ids[: limit - 1] + ids[-1:], types[: limit - 1] + types[-1:])
    return Sequence(ids[:limit], types[:limit])


def check_length(seq_len: int, limit: int, field: str, truncate: bool) -> None:
    if seq_len > limit and not truncate:
        raise InvalidRequestError(
            f"{field} is {seq_len} tokens; this model takes at most {limit} tokens per input. "
            'Shorten it, or send "truncate": true to cut it to the limit',
            param=field,
            code="context_length_exceeded",
        )


def check_count(count: int, field: str) -> None:
    if count == 0:
        raise InvalidRequestError(f"'{field}' must not be empty", param=field)
    if count > MAX_INPUTS_PER_REQUEST:
        raise InvalidRequestError(
            f"'{field}' has {count} items; at most {MAX_INPUTS_PER_REQUEST} per request",
            param=field,
        )


def check_total(sequences: list[Sequence], field: str) -> int:
    total = sum(len(s.ids) for s in sequences)
    if total > MAX_TOKENS_PER_REQUEST:
        raise InvalidRequestError(
            f"'{field}' holds {total} tokens in all; at most {MAX_TOKENS_PER_REQUEST} tokens "
            "per request: split it into several requests",
            param=field,
        )
    return total


def text_sequences(
    tokenizer: Any, texts: list[str], limit: int, *, truncate: bool, field: str
) -> list[Sequence]:
    check_count(len(texts), field)
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequestError(f"{field}[{i}] is an empty string", param=f"{field}[{i}]")
    out = []
    for i, enc in enumerate(tokenizer.encode_batch(texts)):
        check_length(len(enc.ids), limit, f"{field}[{i}]", truncate)
        out.append(_fit(enc.ids, enc.type_ids, enc.special_tokens_mask, limit))
    return out


def token_sequences(
    token_lists: list[list[int]], limit: int, vocab_size: int, *, truncate: bool, field: str
) -> list[Sequence]:
    check_count(len(token_lists), field)
    out = []
    for i, ids in enumerate(token_lists):
        name = f"{field}[{i}]"
        if not ids:
            raise InvalidRequestError(f"{name} is an empty list of token ids", param=name)
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{name} holds token id {bad}, outside this model's vocabulary 0..{vocab_size - 1}",
                param=name,
            )
        check_length(len(ids), limit, name, truncate)
        out.append(Sequence(ids[:limit], [0] * min(len(ids), limit)))
    return out


def pair_sequences(
    tokenizer: Any, query: str, documents: list[str], limit: int, *, truncate: bool
) -> list[Sequence]:
    """(query, document) pairs for a cross-encoder, as one sequence each."""
    check_count(len(documents), "documents")
    out = []
    for i, enc in enumerate(tokenizer.encode_batch([(query, d) for d in documents])):
        check_length(len(enc.ids), limit, f"documents[{i}]", truncate)
        out.append(_fit(enc.ids, enc.type_ids, enc.special_tokens_mask, limit))
    return out
