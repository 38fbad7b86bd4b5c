"""Whether a model's window holds what an agent sends, and each agent told the window."""

from __future__ import annotations

import json
import tomllib

from omlx.agent_context import FirstRequest, context_warning, parse_recorded
from omlx.launch import Connection, launch_plan

CLAUDE = {"claude": FirstRequest("2.1.332", 20_000)}


def test_a_window_that_cannot_hold_the_first_request_is_refused_every_turn() -> None:
    warning = context_warning("claude", "tiny", 8192, CLAUDE)
    assert warning is not None
    assert "about 20,000 tokens (measured with Claude Code 2.1.332)" in warning
    assert "'tiny' has a context window of 8,192 tokens: every request will be refused" in warning
    assert "at least 40k" in warning and "max_context_window" in warning


def test_a_window_that_holds_it_barely_fills_after_a_few_turns() -> None:
    warning = context_warning("claude", "small", 32768, CLAUDE)
    assert warning is not None and "full after a few turns" in warning


def test_enough_room_or_nothing_known_says_nothing() -> None:
    assert context_warning("claude", "big", 40960, CLAUDE) is None
    assert context_warning("claude", "x", None, CLAUDE) is None
    assert context_warning("aider", "x", 1024, CLAUDE) is None


def test_the_recording_keeps_the_largest_count_of_any_tokenizer() -> None:
    data = {"tools": {"codex": {"version": "0.171.0", "tokens": {"a": 9000, "b": 11000}}}}
    assert parse_recorded(data) == {"codex": FirstRequest("0.171.0", 11000)}
    assert parse_recorded({}) == {}


def test_each_launcher_is_told_the_window_in_its_own_setting() -> None:
    conn = Connection("http://127.0.0.1:8000", None, "m", context_window=16384)
    claude = launch_plan("claude", conn)
    assert claude.env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "16384"
    codex = launch_plan("codex", conn).args
    overrides = [codex[i + 1] for i, arg in enumerate(codex) if arg == "-c"]
    assert {"model_context_window": 16384} in [tomllib.loads(o) for o in overrides]
    opencode = json.loads(launch_plan("opencode", conn).env["OPENCODE_CONFIG_CONTENT"])
    limit = opencode["provider"]["omlx"]["models"]["m"]["limit"]
    assert limit == {"context": 16384, "output": 4096}
    # Unknown window: nothing claimed.
    unknown = Connection("http://127.0.0.1:8000", None, "m")
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in launch_plan("claude", unknown).env
