"""``kv_bits`` through a live server: the admin API refuses bad values naming the field,
the built-in SmolLM2 answers with an 8-bit KV cache, /health shows it, and the fit
estimate for it counts the quantized bytes."""

from __future__ import annotations

import time
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
    with live_server(
        tmp_path_factory.mktemp("base"), smollm2_path.parent, profiles=profiles_dir
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
    [({"kv_bits": 6}, "kv_bits", "4 or 8"), ({"kv_group_size": 100}, "kv_group_size", "32, 64")],
)
def test_bad_values_are_a_400_naming_the_field(http, body, field, allowed) -> None:
    reply = http.put(SETTINGS, json=body)
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert message.startswith(f"{field}: ") and allowed in message


def test_the_built_in_model_answers_with_8_bit_kv(http) -> None:
    # kv_bits takes effect at the model's next load. The server loads the model at
    # start: let that load finish, then unload it once the setting is in, so the
    # request's own load is the one that reads it.
    deadline = time.monotonic() + 300
    while http.get("/health").json()["models_state"] == "loading":
        assert time.monotonic() < deadline, "the start-up load did not finish"
        time.sleep(0.2)
    assert http.put(SETTINGS, json={"kv_bits": 8}).status_code == 200
    try:
        assert http.post(f"/admin/api/models/{MODEL}/unload").status_code == 200
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
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        loaded = {m["name"]: m for m in http.get("/health").json()["loaded_models"]}
        assert loaded[MODEL]["kv_bits"] == 8, (loaded, http.get(SETTINGS).text)
        assert "kv_bits" in " ".join(fit["notes"])
    finally:
        assert http.delete(SETTINGS).status_code == 200
        http.post(f"/admin/api/models/{MODEL}/unload")
