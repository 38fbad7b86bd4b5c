"""The fast lane (``./setup.sh test --fast``): which tests it holds, and its guard
against tests that start a process or bind a socket."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.fixtures.fast_lane import TESTS, in_fast_lane


@pytest.mark.parametrize(
    ("path", "inside"),
    [
        ("unit/test_written_tomorrow.py", True),  # a new unit test joins by being there
        ("engine/test_ngram.py", True),
        ("router/test_picker.py", True),
        ("router", True),  # walked, for its pure files
        ("router/test_failover.py", False),  # three live servers
        ("api/test_openai_api.py", False),
        ("app", False),
        ("e2e/test_admin_panel.py", False),
    ],
)
def test_the_lane_holds_the_unit_and_in_process_folders_only(path: str, inside: bool) -> None:
    assert in_fast_lane(TESTS / path) is inside


GUARDED = {
    "a subprocess": "import subprocess; subprocess.run(['true'])",
    "a server's socket": "import socket; socket.socket().bind(('127.0.0.1', 0))",
    "a forked child": "import os; os.fork()",
    "multiprocessing's spawn": """
        import multiprocessing
        process = multiprocessing.get_context('spawn').Process(target=print)
        process.start()
    """,
}


@pytest.mark.spawns
@pytest.mark.parametrize("what", list(GUARDED))
def test_the_guard_refuses_a_process_or_a_socket(what: str) -> None:
    """In a child interpreter (the guard cannot be removed once installed)."""
    code = "from tests.fixtures.fast_lane import install_guard\ninstall_guard()\n"
    code += textwrap.dedent(GUARDED[what])
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=TESTS.parent
    )
    assert proc.returncode == 1
    assert "FastLaneViolation" in proc.stderr and "mark the test" in proc.stderr, proc.stderr
