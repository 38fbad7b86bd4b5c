from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server


@pytest.fixture(scope="module")
def server(
    tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("base"),
        tiny_models_dir,
        scheduler={"max_concurrent_requests": 16, "prefill_step_size": 64},
        profiles=profiles_dir,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    # No retries: a 503 or a dropped connection must show up in the test.
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
