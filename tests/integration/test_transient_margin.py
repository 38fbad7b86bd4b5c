"""The "auto" transient margin on the real server: a small ceiling that fits the
built-in model plus one prefill chunk serves requests, and the front door agrees with
the capacity the load-time auto-profile reports."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from mlx_lm.models.cache import KVCache

from tests.fixtures.servers import serve_process

HEADERS = {"X-Omlx-Client": "test"}
# Measured on Linux (MLX CPU backend, float32 SmolLM2): the loaded server holds about
# 0.71 GB and one 512-token prefill chunk adds about 0.16 GB, so 1.2 GB fits both.
CEILING = "1200MB"


def _token_ids(count: int) -> list[int]:
    """A prompt of exactly ``count`` token ids, spread over SmolLM2's vocabulary."""
    return [100 + (i * 7919) % 49_000 for i in range(count)]


def _settled_capacity(http: httpx.Client, model: str) -> int:
    """The KV capacity once the idle server's baseline holds still (it follows the
    live process, which moves as requests leave memory behind or hand it back)."""
    last = None
    for _ in range(50):
        listed = {m["name"]: m for m in http.get("/admin/api/models").json()["models"]}
        capacity = listed[model]["kv_profile"]["max_kv_tokens"]
        if capacity == last:
            return capacity
        last = capacity
        time.sleep(0.6)
    raise AssertionError(f"the KV capacity never settled (last {last})")


def _complete(http: httpx.Client, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    return http.post("/v1/completions", json=body, headers=HEADERS)


@pytest.mark.slow
def test_a_small_ceiling_serves_the_builtin_model_and_agrees_with_its_profile(
    smollm2_path: Path, tmp_path: Path
) -> None:
    model = smollm2_path.name
    flags = ("--max-process-memory", CEILING)
    with (
        serve_process(tmp_path / "base", smollm2_path.parent, *flags) as (_, url),
        httpx.Client(base_url=url, timeout=300) as http,
    ):
        hi = http.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 4,
            },
            headers=HEADERS,
        )
        assert hi.status_code == 200, hi.text
        assert hi.json()["choices"][0]["message"]["content"]

        listed = {m["name"]: m for m in http.get("/admin/api/models").json()["models"]}
        profile = listed[model]["kv_profile"]
        assert profile["source"] == "measured"
        # The margin is the measured transient of one request's worst step x1.25, not a
        # fixed 1 GB; the batched prefill (8 rows here) is priced per row instead.
        assert profile["batch_rows_widest"] == 8
        step = profile["unbatched_overhead_bytes"]
        assert profile["margin_bytes"] == pytest.approx(1.25 * step, abs=1)
        assert _settled_capacity(http, model) > 512  # room for more than one chunk

        # Model + one full prefill chunk fit the ceiling: a one-chunk prompt is served.
        chunk = _complete(http, model, _token_ids(512))
        assert chunk.status_code == 200, chunk.text
        assert chunk.json()["usage"]["prompt_tokens"] == 512

        # A prompt filling the capacity as its cache holds it (its tokens plus mlx-lm's
        # growth step: memory/dims.allocated_columns) is served: the front door, the
        # capacity and the forward gate all read the live process.
        capacity = _settled_capacity(http, model)
        fits = _complete(http, model, _token_ids(capacity - KVCache.step))
        assert fits.status_code == 200, fits.text

        # One token more is past the capacity: refused at the front door, same boundary.
        capacity = _settled_capacity(http, model)
        over = _complete(http, model, _token_ids(capacity - KVCache.step + 1))
        assert over.status_code == 400, over.text
        assert over.json()["error"]["code"] == "prefill_memory_exceeded"
        assert over.json()["error"]["estimated_bytes"] > over.json()["error"]["limit_bytes"]

        # A prompt that truly cannot fit (its KV alone, 8000 x 45 KiB = 369 MB, beside
        # the 0.71 GB model and the measured chunk passes 1.2 GB) is still refused.
        huge = _complete(http, model, _token_ids(8000))
        assert huge.status_code == 400, huge.text
        error = huge.json()["error"]
        assert error["code"] == "prefill_memory_exceeded"
        assert error["estimated_bytes"] > error["limit_bytes"] == 1_200_000_000
