"""``kv_bits`` through a live server: the admin API refuses bad values naming the field,
the built-in SmolLM2 answers with an 8-bit KV cache, /health shows it, and the fit
estimate for it counts the quantized bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

MODEL = "SmolLM2-135M-Instruct"
SETTINGS = f"/admin/api/models/{MODEL}/settings"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(
    smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    # No load at start: it would load (and, alone, profile) the model with full-precision
    # KV, which every test here unloads before its own load with its KV settings. Two
    # rows of 128-token chunks: each KV setting's load measures its own auto-profile,
    # whose passes (and validation's KV for every row's window) scale with both;
    # nothing here depends on them (the answer's prompt is one chunk).
    with live_server(
        tmp_path_factory.mktemp("base"),
        smollm2_path.parent,
        profiles=profiles_dir,
        models={"load_at_start": False},
        scheduler={"max_concurrent_requests": 2, "prefill_step_size": 128},
    ) as srv:
        yield srv


@pytest.fixture()
def http(server: Server) -> Iterator[httpx.Client]:
    # A script, not a web page: the header the origin guard asks of a bodiless DELETE.
    client = httpx.Client(base_url=server.base_url, timeout=120, headers={"X-Omlx-Client": "t"})
    yield client
    client.close()


@pytest.mark.parametrize(
    ("body", "field", "allowed"),
    [
        ({"kv_bits": 6}, "kv_bits", "4 or 8"),
        ({"kv_group_size": 100}, "kv_group_size", "32, 64"),
        ({"kv_bits": 8, "quantized_kv_start": -1}, "quantized_kv_start", "greater than or equal"),
        ({"kv_bits": 8, "quantized_kv_start": 2.5}, "quantized_kv_start", "valid integer"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(http, body, field, allowed) -> None:
    reply = http.put(SETTINGS, json=body)
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert message.startswith(f"{field}: ") and allowed in message


def _served_with(http, settings: dict) -> tuple[str, dict, dict]:
    """The model's answer about France's capital, its /health entry and its fit
    estimate with ``settings`` (cleared after). KV settings take effect at the model's
    next load: it is not loaded (no load at start, each test unloads it after), so
    the request's own load is the one that reads them."""
    assert not http.get("/health").json()["loaded_models"]
    assert http.put(SETTINGS, json=settings).status_code == 200
    try:
        fit = http.post("/admin/api/models/fit", json={"model": MODEL}).json()
        reply = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0,
                "max_tokens": 24,
            },
        )
        assert reply.status_code == 200
        loaded = {m["name"]: m for m in http.get("/health").json()["loaded_models"]}
        return reply.json()["choices"][0]["message"]["content"], loaded[MODEL], fit
    finally:
        assert http.delete(SETTINGS).status_code == 200
        http.post(f"/admin/api/models/{MODEL}/unload")


def test_the_built_in_model_answers_with_8_bit_kv(http) -> None:
    answer, health, fit = _served_with(http, {"kv_bits": 8})
    assert "Paris" in answer
    assert health["kv_bits"] == 8, health
    assert health["quantized_kv_start"] == 0
    assert "kv_bits" in " ".join(fit["notes"])


def test_quantized_kv_start_is_served_and_shown_beside_kv_bits(http) -> None:
    """8-bit KV from the 8th token on (the chat's prompt is longer: it is quantized
    after its prefill): the model answers, /health shows the start beside kv_bits, and
    the fit estimate names it."""
    answer, health, fit = _served_with(http, {"kv_bits": 8, "quantized_kv_start": 8})
    assert "Paris" in answer
    assert (health["kv_bits"], health["quantized_kv_start"]) == (8, 8)
    assert "after 8 tokens" in " ".join(fit["notes"])
