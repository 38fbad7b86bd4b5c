"""The KV a decode batch really holds, against what the memory guard counts.

mlx-lm's ``BatchKVCache`` (``merge``/``extend``) left-pads every row to the
longest, so one long conversation decoding beside short chats holds rows x the
longest row's KV, not the sum of the requests' tokens. On a Mac one allocation
past the GPU working set can panic the kernel: the guard must count the batch
as mlx-lm allocates it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from omlx.scheduler.plan import KVLoad
from tests.integration.test_memory_admission import generate

LONG, SHORT = 1024, 8  # tokens


def batch_kv_bytes(engine: Any) -> tuple[int, int]:
    """The decode batch's KV arrays' bytes (padding included) and its rows."""
    decode = engine._runner._decode
    held = sum(
        a.nbytes for layer in decode._cache for a in (layer.keys, layer.values) if a is not None
    )
    return held, len(decode.rows)


def test_kv_checked_against_capacity_covers_a_padded_batch(make_pool) -> None:
    """One long prompt and three short ones decode together: the KV tokens the guard
    checks against the model's KV capacity each step cover the batch's real KV
    (mlx-lm grows a cache up to one step of columns per row past its tokens: counted)."""
    pool = make_pool(max_concurrent_requests=8, prefill_step_size=512)

    async def main() -> list[tuple[int, int, int]]:
        engine = await pool.get_engine("slow-llama")
        gate, dims = engine.gate, engine.gate.guard.dims
        seen: list[tuple[int, int, int]] = []  # (real bytes, rows, bytes counted)
        checked = gate.kv_over_capacity

        def spy(load: KVLoad) -> bool:
            real, rows = batch_kv_bytes(engine)
            if rows > 1:
                seen.append((real, rows, dims.kv_bytes(load.allocated)))
            return checked(load)

        gate.kv_over_capacity = spy
        long = [5 + j % 400 for j in range(LONG)]
        shorts = [[7 + i + j for j in range(SHORT)] for i in range(3)]
        results = await asyncio.gather(
            generate(engine, "long", long, max_tokens=24),
            *(generate(engine, f"short{i}", p, max_tokens=48) for i, p in enumerate(shorts)),
        )
        assert all(reason in ("stop", "length") for reason, _ in results), results
        return seen

    seen = asyncio.run(main())
    assert any(rows == 4 for _, rows, _ in seen), f"never decoded in one batch: {seen}"
    real, rows, counted = max(seen, key=lambda s: s[0] - s[2])
    assert real <= counted, (
        f"a {rows}-row decode batch holds {real} bytes of KV; the guard counts {counted}"
    )


def test_short_requests_wait_while_their_padded_batch_passes_the_kv_capacity(make_pool) -> None:
    """A KV capacity of 3000 tokens, a 1024-token prompt decoding: a short chat padded
    to it and grown (two rows: 2 x 1024+256+) fits beside it, a third row (3 x 1280+)
    does not, though the three prompts' tokens sum to 1040. The others wait in the
    queue, and all complete."""
    pool = make_pool(memory={"max_kv_tokens": 3000}, max_concurrent_requests=8)

    async def main() -> tuple[int, Any]:
        engine = await pool.get_engine("slow-llama")
        most_rows = 0
        checked = engine.gate.kv_over_capacity

        def spy(load: KVLoad) -> bool:
            nonlocal most_rows
            most_rows = max(most_rows, batch_kv_bytes(engine)[1])
            return checked(load)

        engine.gate.kv_over_capacity = spy
        long = asyncio.ensure_future(
            generate(engine, "long", [5 + j % 400 for j in range(LONG)], max_tokens=32)
        )
        while engine._runner._decode.rows == []:
            await asyncio.sleep(0.01)
        shorts = [generate(engine, f"s{i}", [7 + i + j for j in range(SHORT)]) for i in range(3)]
        results = await asyncio.gather(long, *shorts)
        assert all(reason in ("stop", "length") for reason, _ in results), results
        return most_rows, engine.gate.deferrals

    most_rows, deferrals = asyncio.run(main())
    assert deferrals["kv_capacity"] > 0, deferrals
    assert most_rows <= 2, f"{most_rows} rows padded to 1024+ tokens ran under a 2500 capacity"
