from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omlx.api.server import Server
from omlx.memory.dims import model_dims
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_models import build_tiny_model

# Tiny random models whose mlx-lm classes split: llama has `shard` (tensor parallel),
# qwen2 has `pipeline` (pipeline parallel). The built-in SmolLM2 splits neither way
# across 2 ranks (test_loading.py says why).
TP_MODEL = "tiny-llama"
PP_MODEL = "tiny-qwen2"


@pytest.fixture(scope="session")
def split_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("split-models")
    build_tiny_model(root / TP_MODEL, "llama", seed=0)
    build_tiny_model(root / PP_MODEL, "gguf-qwen2", seed=3)
    return root


# Package scope: the server stops when the distributed tests are done (an idle
# server left running samples MLX's memory counters beside later tests).
@pytest.fixture(scope="package")
def single_server(
    split_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The one-process server whose greedy output the split ones must give."""
    with live_server(
        tmp_path_factory.mktemp("single"),
        split_models_dir,
        scheduler={"max_concurrent_requests": 8},
        cache={"enabled": False},
    ) as srv:
        yield srv


@pytest.fixture(scope="package")
def single_client(single_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=single_server.base_url + "/v1", api_key="unused", max_retries=0)


def client_for(url: str) -> openai.OpenAI:
    # No retries: a 503 or a dropped connection must show up in the test.
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def half_the_kv_of(models_dir: Path, model: str) -> int:
    """Half of the KV bytes a token of ``model`` takes in one process (float32 tiny
    models): each of two ranks holds half of its heads or half of its layers."""
    config = json.loads((models_dir / model / "config.json").read_text())
    dims = model_dims(config, kv_dtype_bytes=4)
    assert dims is not None
    return dims.kv_bytes_per_token // 2
