"""/admin/api/cache/clear on the SSD tier is bounded: a clear slower than the bound
(here: tens of thousands of block files to unlink) answers 503 with Retry-After and
a log line, the server keeps answering meanwhile, and the clear still finishes."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest

from omlx.api import admin_routes
from omlx.cache.location import SSD_ROOT_NAME, model_folder_name
from omlx.cache.ssd import BLOCK_SUFFIX
from tests.fixtures.servers import live_server

NUM_FILES = 30_000


def blocks_in(folder: Path) -> int:
    return sum(1 for _ in folder.glob(f"*{BLOCK_SUFFIX}"))


def test_a_slow_ssd_clear_answers_503_and_finishes_in_the_background(
    tiny_models_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = {"hot_cache_mode": "write-through", "block_size": 16}
    with (
        live_server(tmp_path, tiny_models_dir, cache=cache) as server,
        httpx.Client(base_url=server.base_url, timeout=60) as http,
    ):
        ask = {"model": "tiny-llama", "prompt": "Hello " * 40, "max_tokens": 2}
        assert http.post("/v1/completions", json=ask).status_code == 200  # opens the store
        folder = server.settings.cache_dir / SSD_ROOT_NAME / model_folder_name("tiny-llama")
        for i in range(NUM_FILES):  # block-named files: the clear unlinks every one
            (folder / f"{i:016x}{BLOCK_SUFFIX}").touch()
        monkeypatch.setattr(admin_routes, "CACHE_CLEAR_TIMEOUT_S", 0.05, raising=False)
        with caplog.at_level(logging.WARNING, logger="omlx.api.admin_routes"):
            started = time.monotonic()
            cleared = http.post("/admin/api/cache/clear", json={"tier": "ssd"})
            answered_s = time.monotonic() - started
            # The event loop stays free while the clear runs.
            assert http.get("/health").status_code == 200
        assert cleared.status_code == 503, cleared.text
        assert int(cleared.headers["retry-after"]) >= 1
        assert "in the background" in cleared.json()["error"]["message"]
        assert answered_s < 5
        assert any("cache clear (tier ssd) still running" in r.getMessage() for r in caplog.records)
        deadline = time.monotonic() + 60
        while blocks_in(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert blocks_in(folder) == 0
