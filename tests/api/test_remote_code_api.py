"""A model folder's own Python code runs only when its settings allow it: a text, a
vision and an embedding model whose tokenizer_config.json's auto_map names a module in
the folder (one that writes a marker file when imported). Requested through a live
server, each is refused with a 403 saying what to change and the module never runs;
with ``trust_remote_code`` set through the admin API, the next request loads it and
the module ran."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omlx.api.server import Server
from omlx.quant.tasks import FINISHED_PHASES
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_encoders import build_tiny_decoder_embedder
from tests.fixtures.tiny_models import build_tiny_model
from tests.fixtures.tiny_vlms import build_tiny_vlm

pytestmark = pytest.mark.slow

# A working tokenizer class (the folder's tokenizer.json) whose import leaves a mark.
MODULE = """
from pathlib import Path

from transformers import PreTrainedTokenizerFast

Path({marker!r}).write_text("imported")


class MarkerTokenizer(PreTrainedTokenizerFast):
    pass
"""


def ship_code(folder: Path, marker: Path) -> None:
    """Make ``folder``'s tokenizer its own module, as Kimi's and Qwen-1's checkpoints do."""
    (folder / "tokenization_marker.py").write_text(MODULE.format(marker=str(marker)))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_marker.MarkerTokenizer"]}
    config_path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Outside the model dir: where each folder's module leaves its mark."""
    return tmp_path_factory.mktemp("marks")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, marks: Path) -> Path:
    root = tmp_path_factory.mktemp("remote-code-models")
    for folder in (
        build_tiny_model(root / "code-llm", "llama", seed=0),
        build_tiny_vlm(root / "code-vlm", "llava", seed=0),
        build_tiny_decoder_embedder(root / "code-embedder", seed=1),
        build_tiny_model(root / "code-quant", "llama", seed=2),
    ):
        ship_code(folder, marks / f"{folder.name}.imported")
    return root


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("remote-code"), models_dir, models={"load_at_start": False}
    ) as srv:
        yield srv


def ask(server: Server, name: str) -> httpx.Response:
    if name == "code-embedder":
        return httpx.post(
            server.base_url + "/v1/embeddings", json={"model": name, "input": "hi"}, timeout=120
        )
    body: dict[str, Any] = {
        "model": name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("name", ["code-llm", "code-vlm", "code-embedder"])
def test_folder_code_runs_only_once_allowed(
    server: Server, models_dir: Path, marks: Path, name: str
) -> None:
    mark = marks / f"{name}.imported"
    assert (models_dir / name / "tokenization_marker.py").is_file()  # the premise

    refused = ask(server, name)
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "remote_code_not_allowed"
    assert error["param"] == "trust_remote_code"
    assert (
        f"model '{name}' ships its own Python code (tokenization_marker.py, named by "
        "auto_map in tokenizer_config.json)" in error["message"]
    )
    assert "set trust_remote_code: true in its settings" in error["message"]
    assert not mark.exists()

    settings = server.base_url + f"/admin/api/models/{name}/settings"
    changed = httpx.put(settings, json={"trust_remote_code": True}, timeout=60)
    assert changed.status_code == 200, changed.text
    assert changed.json()["settings"]["trust_remote_code"] is True

    served = ask(server, name)
    assert served.status_code == 200, served.text
    assert mark.read_text() == "imported"


def test_the_quantizer_runs_folder_code_only_once_allowed(
    server: Server, models_dir: Path, marks: Path
) -> None:
    """oQ loads the tokenizer (its calibration text) in a worker process."""
    tasks = server.base_url + "/admin/api/quant/tasks"
    body = {"model": "code-quant", "level": "oQ4", "output_name": "code-quant-oq4"}
    refused = httpx.post(tasks, json=body, timeout=60)
    assert refused.status_code == 403, refused.text
    assert "tokenization_marker.py" in refused.json()["error"]["message"]
    assert not (marks / "code-quant.imported").exists()

    settings = server.base_url + "/admin/api/models/code-quant/settings"
    assert httpx.put(settings, json={"trust_remote_code": True}, timeout=60).status_code == 200
    started = httpx.post(tasks, json=body, timeout=60)
    assert started.status_code == 201, started.text
    task_url = f"{tasks}/{started.json()['id']}"
    deadline = time.monotonic() + 180
    while (task := httpx.get(task_url, timeout=60).json())["phase"] not in FINISHED_PHASES:
        assert time.monotonic() < deadline, f"task stuck in {task['phase']}"
        time.sleep(0.2)
    assert task["phase"] == "done", task["error"]
    assert (marks / "code-quant.imported").read_text() == "imported"
