"""Prompt-lookup (n-gram) drafting: guess a request's next tokens by copying
them from its own prompt and output. Pure Python, no MLX.

A coding agent's answer repeats the files and diffs it was given: when the
last few tokens of the text so far appeared earlier, what followed them then
is a good guess for what follows now. The guesses are only proposals: the
decode step verifies them against the model (speculative.py) and keeps the
ones the model would have produced itself.

The index maps every n-gram (n = 1..``max_n``) to where its latest earlier
occurrence ended, so a proposal is a dictionary lookup, not a scan of the
context; tokens are indexed as they arrive, once each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from omlx.scheduler import Request

__all__ = ["NgramDrafter", "drafter_for"]


def drafter_for(request: Request, history: Sequence[int]) -> NgramDrafter | None:
    """A drafter over ``history``, unless the request opted out of speculation
    or wants logprobs (those decode one token per step: see speculative.py)."""
    if not request.sampling.speculative or request.sampling.logprobs is not None:
        return None
    return NgramDrafter(history)


class NgramDrafter:
    """One request's token history and its n-gram index.

    ``propose(k)``: the tokens that followed the latest earlier occurrence of
    the history's last ``n`` tokens, longest ``n`` first (``max_n`` down to
    ``min_n``), at most ``k`` of them; empty when nothing matches.
    """

    def __init__(self, tokens: Iterable[int] = (), *, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self._tokens: list[int] = list(tokens)
        self._max_n, self._min_n = max_n, min_n
        # n -> n-gram -> the index just past its latest indexed occurrence.
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        # Occurrences ending before this index are in ``_ends``.
        self._indexed = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        self._tokens.extend(tokens)

    def append(self, token: int) -> None:
        self._tokens.append(token)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        tokens = self._tokens
        size = len(tokens)
        self._index_up_to(size - 1)
        for n in range(self._max_n, self._min_n - 1, -1):
            if n > size:
                continue
            end = self._ends[n].get(tuple(tokens[size - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []

    def _index_up_to(self, last_end: int) -> None:
        """Index every n-gram ending at or before ``last_end`` (exclusive end):
        each has at least one token after it. The history's own suffix (ending
        at its length) stays out, so a lookup finds an earlier occurrence."""
        tokens = self._tokens
        for end in range(max(self._indexed, 1), last_end + 1):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, last_end + 1)
