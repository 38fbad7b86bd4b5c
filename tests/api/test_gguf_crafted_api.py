"""The admin panel's GGUF import given crafted files: a clear 400, nothing written,
and the server keeps serving (the import runs in its own limited process)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.test_gguf_crafted import model_attacks, tiny_llama_gguf_bytes

KEY = "sk-gguf-crafted"
# As the admin panel sends them: JSON with its client header.
HEADERS = {"Authorization": f"Bearer {KEY}", "X-Omlx-Client": "test"}
# In-place edits of a complete model. Without the header checks, mlx 0.32's reader
# aborts on 20 dimensions and divides by zero on type 4 (either kills the process).
ATTACKS = ["n-dims-20", "type-4", "dims-wrap", "offset-wraps", "token-count"]


@pytest.fixture(scope="module")
def attacks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    folder = tmp_path_factory.mktemp("attacks")
    files = {}
    for name, data, says in model_attacks(tiny_llama_gguf_bytes(folder)):
        (folder / f"{name}.gguf").write_bytes(data)
        files[name] = (folder / f"{name}.gguf", says)
    return files


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("crafted-models")
    build_tiny_model(root / "tiny-llama", "llama", seed=0)
    return root


@pytest.fixture(scope="module")
def server(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("crafted-base")
    with live_server(
        base, models_dir, server={"api_key": KEY}, cache={"enabled": False}, profiles=profiles_dir
    ) as srv:
        yield srv


@pytest.mark.parametrize("attack", ATTACKS)
def test_crafted_gguf_import_is_a_clear_error_and_the_server_keeps_serving(
    server: Server, models_dir: Path, attacks: dict[str, tuple[Path, str]], attack: str
) -> None:
    source, says = attacks[attack]
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        response = http.post(
            "/admin/api/models/import-gguf",
            json={"path": str(source), "name": attack},
            headers=HEADERS,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "import_failed"
        assert re.search(says, error["message"]), error["message"]
        assert sorted(p.name for p in models_dir.iterdir()) == ["tiny-llama"]  # nothing left
        assert http.get("/health").status_code == 200
