"""Three real omlx servers on loopback and a router in front of them.

A and B serve tiny-llama and slow-llama; C serves those and tiny-qwen3, and has
an API key of its own (the router is given it per backend)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from omlx.api.server import Server
from omlx.router.config import BackendSpec, RouterConfig
from omlx.router.server import RouterServer
from tests.fixtures.servers import free_port, live_server

ROUTER_KEY = "router-key"
C_KEY = "backend-c-key"
SHARED_MODELS = ("tiny-llama", "slow-llama")


@dataclass
class Fleet:
    a: Server
    b: Server
    c: Server
    router: RouterServer

    @property
    def backends(self) -> dict[str, Server]:
        return {s.base_url: s for s in (self.a, self.b, self.c)}


def model_dir(root: Path, tiny_models_dir: Path, names: tuple[str, ...]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).symlink_to(tiny_models_dir / name, target_is_directory=True)
    return root


def start_router(specs: list[BackendSpec], **overrides: Any) -> RouterServer:
    settings: dict[str, Any] = {"poll_interval_s": 0.3, **overrides}
    config = RouterConfig(backends=tuple(specs), port=free_port(), **settings)
    router = RouterServer(config)
    router.start_in_thread()
    return router


@pytest.fixture(scope="package")
def shared_dir(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("shared-models"), tiny_models_dir, SHARED_MODELS)


@pytest.fixture(scope="package")
def fleet(
    shared_dir: Path,
    tiny_models_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    profiles_dir: Path,
) -> Iterator[Fleet]:
    c_dir = model_dir(
        tmp_path_factory.mktemp("c-models"), tiny_models_dir, (*SHARED_MODELS, "tiny-qwen3")
    )
    cache = {"block_size": 16}
    with ExitStack() as stack:
        a = stack.enter_context(
            live_server(
                tmp_path_factory.mktemp("a"), shared_dir, cache=cache, profiles=profiles_dir
            )
        )
        b = stack.enter_context(
            live_server(
                tmp_path_factory.mktemp("b"), shared_dir, cache=cache, profiles=profiles_dir
            )
        )
        c = stack.enter_context(
            live_server(
                tmp_path_factory.mktemp("c"),
                c_dir,
                cache=cache,
                server={"api_key": C_KEY},
                profiles=profiles_dir,
            )
        )
        specs = [BackendSpec(a.base_url), BackendSpec(b.base_url), BackendSpec(c.base_url, C_KEY)]
        router = start_router(specs, api_key=ROUTER_KEY)
        stack.callback(router.stop)
        yield Fleet(a, b, c, router)
