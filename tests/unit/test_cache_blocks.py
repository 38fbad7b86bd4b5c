from __future__ import annotations

import subprocess
import sys

import pytest

from omlx.cache.blocks import block_keys

BS = 4
MODEL = "org/model-4bit"


# --- keys ---


def test_keys_one_per_full_block_only() -> None:
    assert len(block_keys(MODEL, list(range(11)), BS)) == 2
    assert len(block_keys(MODEL, list(range(12)), BS)) == 3
    assert block_keys(MODEL, [1, 2, 3], BS) == []


def test_same_inputs_same_keys() -> None:
    tokens = list(range(8))
    assert block_keys(MODEL, tokens, BS, ("lora-a",)) == block_keys(MODEL, tokens, BS, ("lora-a",))
    assert all(len(key) == 32 for key in block_keys(MODEL, tokens, BS))


def test_keys_of_vocabulary_ids_are_unchanged_and_an_image_placeholder_has_one() -> None:
    # The SSD tier's blocks from before keep their keys: a vocabulary id packs as the
    # unsigned 32-bit it did. mlx-vlm's image placeholder (-200: fastvlm, llava_bunny)
    # gets a key of its own.
    import hashlib
    import struct

    from omlx.cache.blocks import chain_key

    parent = b"p" * 32
    ids = [0, 1, 151_935, 2**31 - 1]
    unsigned = hashlib.blake2b(parent + struct.pack("<4I", *ids), digest_size=32).digest()
    assert chain_key(parent, ids) == unsigned
    placeholder = chain_key(parent, [5, -200, -200, 6])
    assert placeholder != chain_key(parent, [5, 0, 0, 6])


def test_key_depends_on_parent_model_and_extras() -> None:
    base = block_keys(MODEL, [1, 2, 3, 4, 5, 6, 7, 8], BS)
    other_parent = block_keys(MODEL, [9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert base[1] != other_parent[1]  # same tokens in block 1, different parent
    assert block_keys("other/model", [1, 2, 3, 4], BS)[0] != base[0]
    assert block_keys(MODEL, [1, 2, 3, 4], BS, ("lora-a",))[0] != base[0]
    assert (
        block_keys(MODEL, [1, 2, 3, 4], BS, ("a", "b"))[0]
        != block_keys(MODEL, [1, 2, 3, 4], BS, ("ab",))[0]
    )


@pytest.mark.spawns
def test_keys_stable_across_processes() -> None:
    code = (
        "from omlx.cache.blocks import block_keys;"
        f"print(','.join(k.hex() for k in block_keys({MODEL!r}, list(range(8)), {BS}, ('x',))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PYTHONPATH": "."},
    ).stdout.strip()
    assert out == ",".join(k.hex() for k in block_keys(MODEL, list(range(8)), BS, ("x",)))
