"""Fixed-size token blocks, their chained keys, and a prefix index over them.

Pure Python on purpose (no mlx/numpy): this layer only decides which block slots a
request uses and which of them already hold a cached prefix. The RAM and SSD tiers
store each block's KV data under the same keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_BLOCK_SIZE = 256
KEY_VERSION = b"omlx-kv-block-v1"
KEY_NUM_BYTES = 32


def _hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=KEY_NUM_BYTES)


def _length_prefixed(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def root_key(model_id: str, extra_keys: tuple[str, ...] = ()) -> bytes:
    """The parent of a sequence's first block: binds every key to model and extras."""
    h = _hasher()
    h.update(KEY_VERSION)
    h.update(_length_prefixed(model_id))
    h.update(struct.pack("<Q", len(extra_keys)))
    for extra in extra_keys:
        h.update(_length_prefixed(extra))
    return h.digest()


def chain_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    # Explicit little-endian uint32 so keys match across machines, processes and restarts.
    h = _hasher()
    h.update(parent_key)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def block_keys(
    model_id: str,
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    extra_keys: tuple[str, ...] = (),
) -> list[bytes]:
    """One 32-byte key per FULL block of token_ids; a trailing partial block gets none.

    Keys are stable across processes (use ``key.hex()`` as a file name).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = root_key(model_id, extra_keys)
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass(slots=True)
class Block:
    block_id: int
    key: bytes | None = None
    ref_count: int = 0
    num_tokens: int = 0


class BlockPool:
    """num_blocks slots, a key -> block id index, and an LRU of freed blocks.

    A freed block keeps its key and content (still a cache hit) until allocate()
    reuses it; reuse takes the least recently freed block first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._index: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks blank blocks (ref_count 1), evicting the oldest freed ones."""
        if not self.can_allocate(num_blocks):
            raise ValueError(f"need {num_blocks} blocks, only {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                del self._index[block.key]
                self.num_evictions += 1
            block.key, block.ref_count, block.num_tokens = None, 1, 0
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; at zero it joins the free LRU, key kept."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    deallocate = free

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of keys (stops at the first miss).

        Read-only: call acquire() on the ids you keep.
        """
        block_ids = []
        for key in keys:
            block_id = self._index.get(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a reference to cached blocks, reviving any that sit in the free LRU."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def register(self, block_id: int, key: bytes) -> bool:
        """Index a full block under key. False if key is already cached elsewhere.

        One copy per key: a duplicate stays unkeyed and is reused without an eviction.
        """
        block = self.blocks[block_id]
        if key in self._index:
            return self._index[key] == block_id
        block.key = key
        self._index[key] = block_id
        return True


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    num_cached_tokens: int
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class _RequestBlocks:
    extra_keys: tuple[str, ...]
    block_table: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # of committed full blocks, in order
    num_tokens: int = 0  # tokens that have a slot in block_table


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, with prefix sharing."""

    def __init__(
        self, model_id: str, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model_id = model_id
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self.num_hits = 0
        self.num_misses = 0
        self.num_cached_tokens_served = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def block_table(self, request_id: str) -> list[int]:
        return list(self._request(request_id).block_table)

    def match(
        self, request_id: str, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()
    ) -> PrefixMatch:
        """Start a request: share the longest cached prefix of its prompt.

        The matched blocks become the start of the request's block table and gain a
        reference. At least one prompt token is always left uncached (the last token's
        logits must be computed), so a prompt made only of full cached blocks drops its
        last block from the hit. Counts hits and misses in blocks.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has blocks")
        num_candidates = max(len(token_ids) - 1, 0) // self.block_size
        keys = block_keys(self.model_id, token_ids, self.block_size, extra_keys)[:num_candidates]
        block_ids = self.pool.lookup(keys)
        self.pool.acquire(block_ids)
        num_cached_tokens = len(block_ids) * self.block_size
        self._requests[request_id] = _RequestBlocks(
            extra_keys, list(block_ids), keys[: len(block_ids)], num_cached_tokens
        )
        self.num_hits += len(block_ids)
        self.num_misses += num_candidates - len(block_ids)
        self.num_cached_tokens_served += num_cached_tokens
        return PrefixMatch(num_cached_tokens, tuple(block_ids))

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> list[int] | None:
        """Make room for num_new_tokens more tokens; return the newly added block ids.

        None (and no change) when the pool has too few free blocks: the caller queues
        or preempts the request. Allocation may evict freed cached blocks.
        """
        request = self._request(request_id)
        num_tokens = request.num_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(request.block_table)
        if not self.pool.can_allocate(num_needed):
            return None
        new_ids = self.pool.allocate(max(num_needed, 0))
        request.block_table.extend(new_ids)
        self._fill(request, num_tokens)
        return new_ids

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Publish the request's newly full blocks so later requests can hit them.

        token_ids are all the request's tokens whose KV is now computed (prompt plus
        generated). Only blocks that are full and have a slot are keyed; if an
        identical key is already cached, that copy stays the shared one.
        """
        request = self._request(request_id)
        num_full = min(len(token_ids), request.num_tokens) // self.block_size
        parent = request.keys[-1] if request.keys else root_key(self.model_id, request.extra_keys)
        for i in range(len(request.keys), num_full):
            start = i * self.block_size
            parent = chain_key(parent, token_ids[start : start + self.block_size])
            self.pool.register(request.block_table[i], parent)
            request.keys.append(parent)

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks; keyed ones stay cached until reused."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise ValueError(f"request {request_id!r} has no blocks (double free?)")
        # Tail blocks first, so eviction takes a sequence's end before its shared start.
        self.pool.free(reversed(request.block_table))

    def _fill(self, request: _RequestBlocks, num_tokens: int) -> None:
        first = request.num_tokens // self.block_size
        for i in range(first, len(request.block_table)):
            block = self.pool.blocks[request.block_table[i]]
            block.num_tokens = min(self.block_size, num_tokens - i * self.block_size)
        request.num_tokens = num_tokens

    def _request(self, request_id: str) -> _RequestBlocks:
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request {request_id!r}")
        return request
