"""The reliability suite: short by default, long with ``OMLX_LONG=1``.

Every test here (and the SIGKILL-during-cache-writes test, which lives with the
cache tests) carries the ``reliability`` marker: ``pytest -m reliability`` runs
just this suite.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

LONG = os.environ.get("OMLX_LONG") == "1"
# Tests kept elsewhere that belong to this suite too.
ALSO_RELIABILITY = ("tests/integration/test_cache_faults.py",)


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    clients: int  # concurrent clients of the load test
    load_s: float  # how long they send requests
    rss_window_s: float  # RSS compared between the first and the last window
    rss_growth_max: float  # allowed growth between them (fraction)
    disconnects: int  # clients that go away mid-request
    schema_examples: int  # schemathesis examples per operation


# The short run cannot prove stability (RSS moves ±3% over seconds); it catches gross leaks.
SHORT = Profile("short", 64, 20.0, 5.0, 0.10, 100, 4)
LONG_PROFILE = Profile("long", 64, 660.0, 60.0, 0.05, 500, 40)


@pytest.fixture(scope="session")
def profile() -> Profile:
    return LONG_PROFILE if LONG else SHORT


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith("tests/reliability/") or path in ALSO_RELIABILITY:
            item.add_marker(pytest.mark.reliability)
