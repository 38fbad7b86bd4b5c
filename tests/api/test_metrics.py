"""/metrics and /admin/api/stats move with real requests and agree with each other."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.prom import scrape, value
from tests.fixtures.servers import live_server

MODEL = "tiny-llama"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("metrics"),
        tiny_models_dir,
        cache={"block_size": 16},
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def stats(server: Server, headers: dict[str, str] | None = None) -> dict:
    resp = httpx.get(server.base_url + "/admin/api/stats", headers=headers, timeout=30)
    resp.raise_for_status()
    return resp.json()


def settle(server: Server) -> None:
    """Wait until the model's engine is idle: the last request's prefix-cache store
    runs on the MLX thread after its response, so cache bytes read before that
    differ between two reads."""
    engine = server.pool.engine(MODEL)
    deadline = time.monotonic() + 30
    while engine is not None and engine.has_work:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)


def chat(client: openai.OpenAI, text: str, **kwargs: object) -> openai.types.CompletionUsage:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=8,
        temperature=0,
        **kwargs,
    )
    assert reply.usage is not None
    return reply.usage


def test_a_chat_completion_moves_tokens_latency_and_request_counters(
    server: Server, client: openai.OpenAI
) -> None:
    before = scrape(server.base_url)
    usage = chat(client, "Count the tokens of this request, please.")
    after = scrape(server.base_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("omlx_prompt_tokens_total", model=MODEL) == usage.prompt_tokens
    assert delta("omlx_completion_tokens_total", model=MODEL) == usage.completion_tokens == 8
    assert delta("omlx_time_to_first_token_seconds_count", model=MODEL) == 1
    assert delta("omlx_time_per_output_token_seconds_count", model=MODEL) == 1
    assert delta("omlx_http_requests_total", route=CHAT, method="POST", status="200") == 1
    assert value(after, "omlx_model_loads_total") >= 1
    assert value(after, "omlx_models_loaded") == 1
    assert value(after, "omlx_model_weights_bytes", model=MODEL) > 0
    assert value(after, "omlx_requests_in_flight", model=MODEL) == 0
    assert value(after, "omlx_memory_hard_limit_bytes") >= value(
        after, "omlx_memory_soft_limit_bytes"
    )
    assert value(after, "omlx_memory_used_bytes") > 0


def test_streams_count_their_tokens_and_show_in_recent_throughput(
    server: Server, client: openai.OpenAI
) -> None:
    before = stats(server)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream a few tokens."}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    after = stats(server)
    tokens = {k: after["tokens"][k] - before["tokens"][k] for k in after["tokens"]}
    assert tokens["prompt_total"] == usage.prompt_tokens
    assert tokens["completion_total"] == usage.completion_tokens == 12
    assert after["requests"]["total"] == before["requests"]["total"] + 1
    # Measured over the last few seconds, so this request is still in the window.
    assert after["throughput"]["decode_tokens_per_s"] > 0
    assert after["throughput"]["prefill_tokens_per_s"] > 0


def test_anthropic_messages_are_counted_too(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    before = scrape(server.base_url)
    message = client.messages.create(
        model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hello there"}]
    )
    after = scrape(server.base_url)
    assert (
        value(after, "omlx_prompt_tokens_total") - value(before, "omlx_prompt_tokens_total")
        == message.usage.input_tokens
    )
    assert (
        value(after, "omlx_completion_tokens_total") - value(before, "omlx_completion_tokens_total")
        == message.usage.output_tokens
    )
    route = {"route": "/v1/messages", "status": "200"}
    assert value(after, "omlx_http_requests_total", **route) == (
        value(before, "omlx_http_requests_total", **route) + 1
    )


def test_refused_requests_count_as_errors(server: Server, client: openai.OpenAI) -> None:
    before = stats(server)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    after = stats(server)
    assert after["requests"]["errors"] == before["requests"]["errors"] + 1
    assert after["requests"]["total"] == before["requests"]["total"] + 1
    samples = scrape(server.base_url)
    assert value(samples, "omlx_http_requests_total", route=CHAT, status="404") >= 1


def test_prefix_cache_hits_show_in_tokens_saved_and_hit_rate(
    server: Server, client: openai.OpenAI
) -> None:
    text = "A long shared prefix that the cache should keep. " * 12
    chat(client, text)
    before_stats, before = stats(server), scrape(server.base_url)
    usage = chat(client, text)
    settle(server)
    after_stats, after = stats(server), scrape(server.base_url)
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= 16
    saved = after_stats["cache"]["tokens_saved"] - before_stats["cache"]["tokens_saved"]
    assert saved == cached
    assert (
        value(after, "omlx_cached_prompt_tokens_total")
        - value(before, "omlx_cached_prompt_tokens_total")
        == cached
    )
    assert value(after, "omlx_prefix_cache_hits_total", model=MODEL) == (
        value(before, "omlx_prefix_cache_hits_total", model=MODEL) + 1
    )
    tokens = after_stats["tokens"]
    assert after_stats["cache"]["hit_rate"] == pytest.approx(
        tokens["cached_total"] / tokens["prompt_total"], abs=1e-4
    )
    assert after_stats["cache"]["hot_bytes"] > 0
    assert value(after, "omlx_cache_bytes", tier="hot") == after_stats["cache"]["hot_bytes"]


def test_stats_and_metrics_read_the_same_counters(server: Server, client: openai.OpenAI) -> None:
    chat(client, "One more request so every counter has something in it.")
    settle(server)
    body, samples = stats(server), scrape(server.base_url)
    inference = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
    http = [s for s in samples if s.name == "omlx_http_requests_total"]
    total = sum(s.value for s in http if s.labels["route"] in inference)
    errors = sum(
        s.value for s in http if s.labels["route"] in inference and int(s.labels["status"]) >= 400
    )
    assert body["requests"]["total"] == total
    assert body["requests"]["errors"] == errors + value(samples, "omlx_stream_errors_total")
    assert body["requests"]["in_flight"] == value(samples, "omlx_requests_in_flight")
    assert body["requests"]["queued"] == value(samples, "omlx_queue_depth")
    assert body["tokens"] == {
        "prompt_total": value(samples, "omlx_prompt_tokens_total"),
        "completion_total": value(samples, "omlx_completion_tokens_total"),
        "cached_total": value(samples, "omlx_cached_prompt_tokens_total"),
    }
    memory = body["memory"]
    assert memory["hard_limit_bytes"] == value(samples, "omlx_memory_hard_limit_bytes")
    assert memory["soft_limit_bytes"] == value(samples, "omlx_memory_soft_limit_bytes")
    assert memory["used_bytes"] == pytest.approx(value(samples, "omlx_memory_used_bytes"), rel=0.1)
    assert body["cache"]["hot_bytes"] == value(samples, "omlx_cache_bytes", tier="hot")
    assert body["cache"]["ssd_bytes"] == value(samples, "omlx_cache_bytes", tier="ssd")
    assert body["uptime_s"] > 0
    assert set(body) == {"uptime_s", "requests", "tokens", "throughput", "memory", "cache"}


def _hold_stream(url: str, started: threading.Event, stop: threading.Event) -> None:
    body = {
        "model": "slow-llama",
        "prompt": "Keep going",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                started.set()
            if stop.is_set():
                return  # closing the connection aborts the request


def test_queue_depth_and_in_flight_while_one_request_waits(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    with live_server(
        tmp_path, tiny_models_dir, scheduler={"max_concurrent_requests": 1}, profiles=profiles_dir
    ) as srv:
        stop = threading.Event()
        first, second = threading.Event(), threading.Event()
        threads = [
            threading.Thread(target=_hold_stream, args=(srv.base_url, ev, stop))
            for ev in (first, second)
        ]
        threads[0].start()
        assert first.wait(60)
        threads[1].start()
        deadline = time.monotonic() + 10
        while stats(srv)["requests"]["in_flight"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        busy, samples = stats(srv), scrape(srv.base_url)
        second_started = second.is_set()
        stop.set()
        for t in threads:
            t.join(60)
        assert busy["requests"]["in_flight"] == 2
        assert busy["requests"]["queued"] == 1  # one slot: the second has no token yet
        assert not second_started
        assert value(samples, "omlx_queue_depth", model="slow-llama") == 1
        deadline = time.monotonic() + 10
        while stats(srv)["requests"]["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.02)
        idle = stats(srv)
        assert idle["requests"]["in_flight"] == 0
        assert idle["requests"]["queued"] == 0


def test_metrics_and_stats_need_the_key_when_one_is_set(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    with live_server(
        tmp_path, tiny_models_dir, server={"api_key": "s3cret"}, profiles=profiles_dir
    ) as srv:
        for path in ("/metrics", "/admin/api/stats"):
            assert httpx.get(srv.base_url + path).status_code == 401
            wrong = httpx.get(srv.base_url + path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert value(scrape(srv.base_url, good), "omlx_uptime_seconds") > 0
        assert stats(srv, {"x-api-key": "s3cret"})["requests"]["total"] == 0


def test_ssd_tier_saves_persisted_and_drops_are_exported(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    """A write-through SSD tier writes every block: /metrics shows the saves, the
    ones on disk and the drops, as the store counts them."""
    cache = {"block_size": 16, "hot_cache_mode": "write-through"}
    with live_server(tmp_path, tiny_models_dir, cache=cache, profiles=profiles_dir) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        chat(client, "Write these words to the disk tier, block after block. " * 4)
        store = srv.pool.engine(MODEL).prefix_cache
        # The request's blocks are stored as it ends (after its answer): wait until
        # the store's counters hold still, written and counted.
        deadline = time.monotonic() + 30
        ssd, last = store.stats()["ssd"], None
        while (ssd != last or ssd["pending_writes"]) and time.monotonic() < deadline:
            time.sleep(0.2)
            last, ssd = ssd, store.stats()["ssd"]
        samples = scrape(srv.base_url)
        assert ssd["saves_persisted"] > 0 and ssd["saves"] >= ssd["saves_persisted"]
        for key in ("saves", "saves_persisted", "drops"):
            assert value(samples, f"omlx_cache_ssd_{key}_total", model=MODEL) == ssd[key]
