"""POST /admin/api/models/fit on a real server, with the real SmolLM2 folder on disk."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from omlx.memory.dims import gated_delta_state_bytes
from tests.fixtures.servers import live_server
from tests.fixtures.state_models import build_gated_delta
from tests.fixtures.tiny_models import build_tiny_model

SMOL = "SmolLM2-135M-Instruct"
GB = 1000**3


@pytest.fixture(scope="module")
def models_dir(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Models and no default: nothing loads at start, so the baseline is the runtime's.
    root = tmp_path_factory.mktemp("fit-models")
    (root / SMOL).symlink_to(smollm2_path, target_is_directory=True)
    build_tiny_model(root / "tiny-llama", "llama", seed=0)
    build_gated_delta(root / "tiny-gdn")
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("base"), models_dir, memory={"max_process_memory": "24GB"}
    ) as srv:
        yield srv


def fit(server: Server, body: object) -> httpx.Response:
    return httpx.post(server.base_url + "/admin/api/models/fit", json=body, timeout=60)


def test_smollm2_fits_under_24gb_with_the_live_runtime_counted(
    server: Server, smollm2_path: Path
) -> None:
    response = fit(server, {"model": SMOL})
    assert response.status_code == 200, response.text
    result = response.json()
    weights = (smollm2_path / "model.safetensors").stat().st_size
    assert result["verdict"] == "fits" and result["message"] == "fits"
    assert result["weights_bytes"] == weights
    assert (result["context_tokens"], result["concurrency"]) == (8192, 8)
    assert result["limit_bytes"] == 24 * GB
    # The running server's own memory (Python, MLX, FastAPI) is part of the need.
    assert result["baseline_bytes"] > 50_000_000
    parts = ("baseline_bytes", "weights_bytes", "kv_bytes", "transient_bytes")
    assert result["total_bytes"] == sum(result[k] for k in parts)


def test_a_folder_path_gets_the_same_estimate_as_the_model(
    server: Server, smollm2_path: Path
) -> None:
    by_name = fit(server, {"model": SMOL}).json()
    by_path = fit(server, {"path": str(smollm2_path)}).json()
    for key in ("verdict", "weights_bytes", "kv_bytes", "context_tokens", "limit_bytes"):
        assert by_path[key] == by_name[key]


def test_a_loaded_model_is_not_counted_twice(server: Server) -> None:
    before = fit(server, {"model": SMOL}).json()
    loaded = httpx.post(server.base_url + f"/admin/api/models/{SMOL}/load", json={}, timeout=600)
    assert loaded.status_code == 200, loaded.text
    after = fit(server, {"model": SMOL}).json()
    # Loading raised the live baseline by the 538 MB of weights (and some runtime);
    # the estimate takes the model's own weights back out, so they count once.
    assert after["baseline_bytes"] - before["baseline_bytes"] < before["weights_bytes"] // 2
    assert after["weights_bytes"] == before["weights_bytes"]


def test_a_hybrid_s_states_are_priced_in_its_fit_and_shown_on_health(
    server: Server, models_dir: Path
) -> None:
    """A gated-delta hybrid: its fit prices each concurrent request's recurrent state
    (from config.json, before a load), and once loaded /health shows the state the
    guard measured from its cache, the same bytes; an attention model shows none."""
    config = json.loads((models_dir / "tiny-gdn" / "config.json").read_text())
    state = gated_delta_state_bytes(config, kv_dtype_bytes=4)  # float32 tiny weights
    result = fit(server, {"model": "tiny-gdn"}).json()
    assert state > 0 and result["state_bytes"] == result["concurrency"] * state
    assert fit(server, {"model": "tiny-llama"}).json()["state_bytes"] == 0
    for name in ("tiny-gdn", "tiny-llama"):
        loaded = httpx.post(
            server.base_url + f"/admin/api/models/{name}/load", json={}, timeout=600
        )
        assert loaded.status_code == 200, loaded.text
    health = httpx.get(server.base_url + "/health", timeout=60).json()
    dims = {m["name"]: m["dims"] for m in health["loaded_models"]}
    assert dims["tiny-gdn"]["state_bytes_per_sequence"] == state
    assert dims["tiny-llama"]["state_bytes_per_sequence"] == 0
    assert dims["tiny-llama"]["kv_bytes_per_token"] > 0


def test_smollm2_under_1gb_does_not_fit_at_full_context(models_dir: Path, tmp_path: Path) -> None:
    """A 1 GB process: without a server the estimate allows 448 tokens per request
    (tests/unit/test_fit.py works it out); a running server's own runtime takes a
    few hundred MB of that, so the answer can only be shorter or "does not fit"."""
    with live_server(tmp_path, models_dir, memory={"max_process_memory": "1GB"}) as srv:
        result = fit(srv, {"model": SMOL}).json()
    assert result["verdict"] in ("fits_shorter_context", "does_not_fit")
    assert result["limit_bytes"] == GB
    if result["verdict"] == "does_not_fit":
        assert result["message"].startswith("does not fit: needs ")
        assert result["message"].endswith("limit 1 GB")
    else:
        assert result["max_context_tokens"] <= 448


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": "no-such-model"}, 404, "no-such-model"),
        ({"path": "relative/dir"}, 400, "absolute"),
        ({"path": "/no/such/folder"}, 400, "no folder"),
        ({}, 400, "exactly one"),
        ({"model": SMOL, "path": "/tmp"}, 400, "exactly one"),
        ([1, 2], 400, "request body"),
        ({"model": SMOL, "context": 10}, 400, "context"),
    ],
)
def test_bad_requests_say_what_to_change(
    server: Server, body: object, status: int, words: str
) -> None:
    response = fit(server, body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_folders_that_are_not_models_are_refused(server: Server, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for folder, words in ((empty, "no config.json"), (no_weights, "no safetensors weights")):
        response = fit(server, {"path": str(folder)})
        assert response.status_code == 400
        assert words in response.json()["error"]["message"]
