"""Prompt-lookup (n-gram) drafting: guess a request's next tokens by copying
them from its own prompt and output. Pure Python, no MLX.

A coding agent's answer repeats the files and diffs it was given: when the
last few tokens of the text so far appeared earlier, what followed them then
is a good guess for what follows now. The guesses are only proposals: the
decode step verifies them against the model (speculative.py) and keeps the
ones the model would have produced itself.

Where to copy from: among the recent earlier occurrences of the last two
tokens, the one whose preceding tokens match the history's longest (code
repeats short pieces like ``    return`` everywhere; the longest match finds
the place in the file being copied), the latest on a tie; with no two-token
match, the latest occurrence of the last token. The index maps each one- and
two-token key to where it occurred, so a proposal is a dictionary lookup and
a few short comparisons, not a scan of the context; tokens are indexed as
they arrive, once each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from omlx.scheduler import Request

__all__ = ["NgramDrafter", "drafter_for"]

# Earlier occurrences of the last two tokens compared per proposal (the latest).
MAX_CANDIDATES = 8
# How far back a candidate's match is followed (past this, a match is a match).
MAX_MATCH = 16


def speculates(request: Request) -> bool:
    """Whether a request may draft: not when it opted out of speculation or wants
    logprobs (those decode one token per step: see speculative.py)."""
    return bool(request.sampling.speculative) and request.sampling.logprobs is None


def drafter_for(request: Request, history: Sequence[int]) -> NgramDrafter | None:
    """A drafter over ``history`` for a request that may draft (else None)."""
    return NgramDrafter(history) if speculates(request) else None


class NgramDrafter:
    """One request's token history and its index.

    ``propose(k)``: up to ``k`` tokens that followed the best earlier match of
    the history's end (see the module docstring); ``min_match`` is the
    shortest match worth a proposal; a match shorter than ``full_match`` tokens
    proposes only as many tokens as it matched (a weak match rarely guesses
    further right). Empty when nothing matches.
    """

    def __init__(self, tokens: Iterable[int] = (), *, min_match: int = 1, full_match: int = 3):
        if not 1 <= min_match <= full_match:
            raise ValueError(f"need 1 <= min_match <= full_match, got {min_match}, {full_match}")
        self._tokens: list[int] = list(tokens)
        self._min_match, self._full_match = min_match, full_match
        # Token -> the index just past its latest indexed occurrence.
        self._last1: dict[int, int] = {}
        # Two tokens -> the indexes just past their indexed occurrences, in order.
        self._ends2: dict[tuple[int, int], list[int]] = {}
        # Occurrences ending before this index are indexed.
        self._indexed = 1

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """The history so far (prompt and output; read-only: a draft model feeds it)."""
        return self._tokens

    def extend(self, tokens: Iterable[int]) -> None:
        self._tokens.extend(tokens)

    def append(self, token: int) -> None:
        self._tokens.append(token)

    def propose(self, k: int) -> list[int]:
        tokens = self._tokens
        size = len(tokens)
        if k <= 0 or size == 0:
            return []
        self._index_up_to(size - 1)
        end, matched = self._best_match()
        if end is None or matched < self._min_match:
            return []
        if matched < self._full_match:
            k = min(k, matched)
        return tokens[end : end + k]

    def _best_match(self) -> tuple[int | None, int]:
        """(where the continuation starts, how many tokens before it match the
        history's end), or (None, 0)."""
        tokens = self._tokens
        size = len(tokens)
        if size >= 2:
            ends = self._ends2.get((tokens[-2], tokens[-1]))
            if ends:
                best, best_len = ends[-1], 0
                for end in reversed(ends[-MAX_CANDIDATES:]):
                    n = 2
                    while n < MAX_MATCH and n < end and tokens[end - 1 - n] == tokens[size - 1 - n]:
                        n += 1
                    if n > best_len:
                        best, best_len = end, n
                return best, best_len
        end1 = self._last1.get(tokens[-1])
        return (end1, 1) if end1 is not None else (None, 0)

    def _index_up_to(self, last_end: int) -> None:
        """Index the keys ending at or before ``last_end`` (exclusive end): each has
        at least one token after it. The history's own end stays out, so a lookup
        finds an earlier occurrence."""
        tokens = self._tokens
        for end in range(self._indexed, last_end + 1):
            self._last1[tokens[end - 1]] = end
            if end >= 2:
                self._ends2.setdefault((tokens[end - 2], tokens[end - 1]), []).append(end)
        self._indexed = max(self._indexed, last_end + 1)
