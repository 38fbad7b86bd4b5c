"""Fixed-size token blocks and their chained keys.

Pure Python on purpose (no mlx/numpy): a key names a block of tokens and everything
before it, stable across processes. The prefix cache (prefix.py) and its RAM and SSD
tiers store each block's KV data under these keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

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
    # Explicit little-endian 32-bit so keys match across machines, processes and restarts;
    # signed: a vocabulary id packs as it did unsigned, and mlx-vlm's image placeholder
    # (-200, models/vlm_families.PLACEHOLDER_ID) packs too.
    h = _hasher()
    h.update(parent_key)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
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
