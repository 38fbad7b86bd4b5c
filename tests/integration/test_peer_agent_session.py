"""The peer benchmark's agent session (benchmarks/peers): every server gets the same
turns, and each turn sends back the conversation with the server's own answers."""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peers"))
from peer_client import Config, PeerClient, agent_session
from prompts import agent_messages, agent_turn


def test_turns_are_the_same_for_every_server_and_carry_the_answers() -> None:
    answers = [f"answer {k}" for k in range(9)]
    for turn in range(10):
        messages = agent_messages("s1", turn, answers)
        assert messages == agent_messages("s1", turn, answers)  # deterministic
        assert len(messages) == 2 + 2 * turn  # system, earlier pairs, the new turn
        assert [m["content"] for m in messages[2::2]] == answers[:turn]
        assert messages[-1] == {"role": "user", "content": agent_turn(turn)}
        if turn:  # the previous request plus its answer is this one's prefix
            previous = agent_messages("s1", turn - 1, answers)
            assert messages[: len(previous)] == previous
    # Another session differs in its first tokens only (so it starts cold on a cache).
    other = agent_messages("s2", 3, answers)
    assert other[0] != agent_messages("s1", 3, answers)[0]
    assert other[1:] == agent_messages("s1", 3, answers)[1:]


def test_tool_results_differ_per_turn_and_are_a_few_hundred_tokens_long() -> None:
    turns = [agent_turn(k) for k in range(10)]
    assert len(set(turns)) == 10
    # ~300 SmolLM2 tokens each (280-345, benchmarks/README.md); characters as a proxy.
    assert all(400 <= len(t) <= 1200 for t in turns)


def test_a_turn_needs_the_earlier_answers() -> None:
    with pytest.raises(ValueError, match="turn 3 needs the 3 earlier answers"):
        agent_messages("s1", 3, ["only one"])


@pytest.fixture(scope="module")
def server(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with live_server(tmp_path_factory.mktemp("base"), tiny_models_dir) as srv:
        yield srv


def test_a_session_against_a_live_server_sends_its_answers_back(server: Server) -> None:
    cfg = Config(agent_turns=3, agent_tokens=6)

    async def run() -> tuple[float, list]:
        async with httpx.AsyncClient(base_url=server.base_url + "/v1", timeout=120) as http:
            return await agent_session(PeerClient(http, "tiny-llama"), cfg)

    wall_s, runs = asyncio.run(run())
    assert len(runs) == 3
    assert wall_s >= sum(r.ttft_s for r in runs)
    assert all(1 <= r.completion_tokens <= 6 for r in runs)
    for before, after in itertools.pairwise(runs):
        # The next prompt holds this one, its answer and a new tool result.
        assert after.prompt_tokens > before.prompt_tokens + before.completion_tokens + 50
