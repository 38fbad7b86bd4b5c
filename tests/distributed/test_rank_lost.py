"""A rank killed mid-run: the request in flight ends with a clear error naming the rank
(no hang), later requests get a 503 naming it, and /health reports it.

The ranks are started as mlx.launch starts them but by hand: mlx.launch itself stops
every rank as soon as one fails, and here rank 0 must outlive rank 1 to be watched."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.distributed.conftest import TP_MODEL, client_for
from tests.distributed.ranks import ranks_by_hand


def test_a_killed_rank_ends_requests_with_an_error_naming_it(
    split_models_dir: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    with ranks_by_hand(tmp_path, split_models_dir, TP_MODEL, "tensor", logs=logs) as (
        url,
        procs,
    ):
        client = client_for(url)
        stream = client.chat.completions.create(
            model=TP_MODEL,
            messages=[{"role": "user", "content": "tell me a long story"}],
            max_tokens=3000,
            temperature=0,
            stream=True,
        )
        chunks = iter(stream)
        for _ in range(3):  # it is decoding on both ranks
            next(chunks)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                pass
        assert time.monotonic() - killed_at < 30
        assert "rank 1 of 2 stopped" in str(info.value)

        # Promptly: rank 0 once froze here (an MLX call waiting on the dead ring's
        # collective, holding the GIL), and every later request hung.
        with pytest.raises(openai.APIStatusError) as later:
            client.with_options(timeout=30).chat.completions.create(
                model=TP_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert later.value.status_code == 503
        assert "rank 1 of 2 stopped" in later.value.message

        report = httpx.get(url + "/health").json()["distributed"]
        assert report["healthy"] is False
        lost = report["ranks"][1]
        assert lost["state"] == "lost" and "closed" in lost["error"]
        assert procs[0].poll() is None  # rank 0 still answers
        # ... and then idles: its engine once retried the lost group's step in a tight
        # loop (hundreds of tracebacks a second, a core busy until the server stopped).
        time.sleep(1.0)
        failed_steps = (logs / "rank0.log").read_text().count("engine step failed")
        assert failed_steps <= 2, f"rank 0 retried the lost step {failed_steps} times"
