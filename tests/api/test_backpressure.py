"""Queue limits and long prefills, each on a server configured for it."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.fixtures.servers import live_server

MODEL = "tiny-llama"
# Decodes ~60 tok/s: a 4000-token request holds its slot for about a minute.
SLOW = "slow-llama"
CHAT = [{"role": "user", "content": "hello"}]


def test_a_full_queue_answers_503_with_retry_after(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    with live_server(
        tmp_path,
        tiny_models_dir,
        scheduler={"max_concurrent_requests": 1, "max_queued_requests": 1},
        profiles=profiles_dir,
    ) as server:
        url = server.base_url + "/v1/chat/completions"
        body = {"model": SLOW, "messages": CHAT, "max_tokens": 4000, "stream": True}
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        with httpx.Client(timeout=60) as http:
            # One request runs and one waits: both are accepted.
            streams = [http.stream("POST", url, json=body) for _ in range(2)]
            responses = [s.__enter__() for s in streams]
            assert [r.status_code for r in responses] == [200, 200]
            third = http.post(url, json={**body, "stream": False})
            assert third.status_code == 503
            assert third.headers["retry-after"] == "1"
            err = third.json()["error"]
            assert err["code"] == "queue_full" and "retry" in err["message"]
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(model=SLOW, messages=CHAT, max_tokens=2)
            assert info.value.status_code == 503
            for stream in streams:
                stream.__exit__(None, None, None)


def test_long_prefill_streams_keepalive_comments_before_the_first_token(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    with live_server(
        tmp_path,
        tiny_models_dir,
        server={"sse_keepalive_s": 0.05},
        scheduler={"prefill_step_size": 16},
        profiles=profiles_dir,
    ) as server:
        long_prompt = [{"role": "user", "content": "the cache keeps blocks " * 150}]
        body = {"model": MODEL, "messages": long_prompt, "max_tokens": 3, "stream": True}
        httpx.post(  # load the model first so only the prefill is timed
            server.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_tokens": 1},
        )
        with httpx.stream(
            "POST", server.base_url + "/v1/chat/completions", json=body, timeout=60
        ) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
        assert first_data > 0
        assert all(line == ": keep-alive" for line in lines[:first_data])
        assert lines[-1] == "data: [DONE]"
