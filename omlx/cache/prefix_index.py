"""Which prefix of a prompt the cache holds, decided over block keys alone. Pure:
no MLX, no block payloads read.

Block keys chain the model identity and every token before the block's end, so a
key the tiers hold is an exact hit. A prompt matches its full blocks in order,
then the longest stored partial tail after them, or (sliceable layouts only) the
first tokens of a stored block after them (a chat template's fixed opening, the
start of a shared system prompt), at least MIN_PARTIAL_TOKENS. A prompt's last
token is never served from the cache: its forward pass gives the logits of the
first output token.

The scheduler asks ``match`` at admission (so a hit counts before anything is
restored); ``PrefixCache.lookup`` restores what it says, on the MLX thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omlx.cache.blocks import block_keys, chain_key, root_key

# Token-granular reuse (sliceable layouts): a stored block whose first tokens
# match the prompt's next ones serves that many, if at least this many (below,
# restoring costs more than it saves).
MIN_PARTIAL_TOKENS = 8
# Blocks remembered per parent for that match (most recent first); a chat
# template's fixed opening is in every recent one.
_CHILDREN_PER_PARENT = 32
_MAX_PARENTS = 4096

# Does a tier (RAM or SSD) hold the block with this hex key?
HasBlock = Callable[[str], bool]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The blocks serving a prompt's prefix, in order: whole blocks (hex keys)
    then, optionally, the first ``cut`` tokens of one more."""

    keys: tuple[str, ...] = ()
    block_tokens: tuple[int, ...] = ()
    # Tokens taken from the last block when it is served in part (0: whole).
    cut: int = 0

    @property
    def num_tokens(self) -> int:
        if not self.keys:
            return 0
        whole = sum(self.block_tokens[:-1])
        return whole + (self.cut or self.block_tokens[-1])

    def shortened(self, num_blocks: int) -> PrefixMatch:
        """The first ``num_blocks`` blocks (a later one left the tiers meanwhile)."""
        cut = self.cut if num_blocks == len(self.keys) else 0
        return PrefixMatch(self.keys[:num_blocks], self.block_tokens[:num_blocks], cut)


class PrefixIndex:
    """One model's prefix lookups over block keys; ``has_block`` asks the tiers.
    Remembers the blocks stored in this process by their parent, for partial
    matches (blocks loaded from the SSD after a restart match whole)."""

    def __init__(self, identity: str, block_size: int, *, sliceable: bool, has_block: HasBlock):
        self.identity = identity
        self.block_size = block_size
        self.sliceable = sliceable
        self._has_block = has_block
        self._root = root_key(identity)
        # parent key -> {child block key: its tokens}, most recent first.
        self._children: OrderedDict[bytes, OrderedDict[bytes, tuple[int, ...]]] = OrderedDict()

    def root_for(self, extra_keys: tuple[str, ...]) -> bytes:
        return root_key(self.identity, extra_keys) if extra_keys else self._root

    def match(self, prompt_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> PrefixMatch:
        """The longest cached prefix of ``prompt_ids[:-1]``."""
        limit, size = len(prompt_ids) - 1, self.block_size
        keys: list[str] = []
        parent = self.root_for(extra_keys)
        for key in block_keys(self.identity, prompt_ids[:limit], size, extra_keys):
            if not self._has_block(key.hex()):
                break
            keys.append(key.hex())
            parent = key
        lengths = [size] * len(keys)
        rest = prompt_ids[len(keys) * size : limit]
        tail = self._find_tail(parent, rest[: size - 1])
        if tail is not None:
            return PrefixMatch((*keys, tail[0]), (*lengths, tail[1]))
        partial = self._find_partial(parent, rest) if self.sliceable else None
        if partial is not None:
            child, num_tokens, cut = partial
            return PrefixMatch((*keys, child), (*lengths, num_tokens), cut)
        return PrefixMatch(tuple(keys), tuple(lengths))

    def _find_tail(self, parent: bytes, rest: Sequence[int]) -> tuple[str, int] | None:
        """The longest stored partial block after ``parent`` that prefixes ``rest``."""
        for length in range(len(rest), 0, -1):
            key = chain_key(parent, rest[:length]).hex()
            if self._has_block(key):
                return key, length
        return None

    def _find_partial(self, parent: bytes, rest: Sequence[int]) -> tuple[str, int, int] | None:
        """The stored block after ``parent`` whose first tokens ``rest`` starts with
        (the longest such run, at least MIN_PARTIAL_TOKENS): (key, its tokens, run)."""
        children = self._children.get(parent)
        if not children:
            return None
        best, best_len = None, MIN_PARTIAL_TOKENS - 1
        for key, tokens in children.items():
            n = common_prefix(tokens, rest)
            if n > best_len:
                best, best_len = key, n
        if best is None:
            return None
        if not self._has_block(best.hex()):
            del children[best]  # evicted since
            return None
        num_tokens = len(children[best])
        return best.hex(), num_tokens, 0 if best_len == num_tokens else best_len

    def remember(self, parent: bytes, key: bytes, tokens: Sequence[int]) -> None:
        """A block stored in this process, for partial matches."""
        if not self.sliceable:
            return
        children = self._children.setdefault(parent, OrderedDict())
        self._children.move_to_end(parent)
        children[key] = tuple(tokens)
        children.move_to_end(key, last=False)
        while len(children) > _CHILDREN_PER_PARENT:
            children.popitem()
        while len(self._children) > _MAX_PARENTS:
            self._children.popitem(last=False)

    def clear(self) -> None:
        self._children.clear()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class HitSpan:
    """Which prompt lengths one rank's hit can be restored at (a model split across
    ranks restores the same length everywhere): any multiple of ``step`` up to
    ``whole``, and ``total``. Sliceable KV cuts anywhere (step 1); recurrent or window
    state only at a block's end (step: the block size; ``total``: a partial tail)."""

    step: int
    whole: int
    total: int

    def holds(self, num_tokens: int) -> bool:
        return num_tokens == self.total or (
            num_tokens <= self.whole and num_tokens % self.step == 0
        )

    def lengths(self) -> list[int]:
        """Every restorable length, longest first."""
        return [self.total, *range(self.whole - self.whole % self.step, -1, -self.step)]


# A miss: only the empty prefix.
NO_HIT = HitSpan(1, 0, 0)


def common_hit(spans: Sequence[HitSpan]) -> int:
    """The longest hit every rank can restore (0: none). Candidates come from the
    rank with the coarsest step, so the work is one pass over its block ends."""
    if not spans:
        return 0
    ceiling = min(span.total for span in spans)
    coarsest = max(spans, key=lambda span: span.step)
    if coarsest.step == 1:
        return ceiling
    for length in coarsest.lengths():
        if length <= ceiling and all(span.holds(length) for span in spans):
            return length
    return 0
