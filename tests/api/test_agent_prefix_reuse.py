"""Recorded Claude Code traffic replayed on a live server: each agent turn reuses the
previous turn's prompt from the prefix cache, including the turn where Claude Code
loads a deferred tool with ToolSearch (benchmarks/agent_traffic: the requests are what
Claude Code 2.1.332 sent to a recorder whose model side was scripted).

The model is a random tiny llama with SmolLM2's tokenizer and chat template (so the
prompts are as long as with the built-in model, ~12k tokens) and a 64k window.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_models import build_tiny_model

SESSION = Path(__file__).parents[2] / "benchmarks" / "agent_traffic" / "sessions" / "claude.json"
MODEL = "tiny-smol-64k"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("agent-models")
    build_tiny_model(models / MODEL, "llama", vocab_size=49152, max_position_embeddings=65536)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_path / name, models / MODEL / name)
    with live_server(
        tmp_path_factory.mktemp("base"), models, generation={"max_context_window": 65536}
    ) as srv:
        yield srv


def claude_requests() -> list[dict[str, Any]]:
    """The Messages requests Claude Code sent that declare tools (its agent turns)."""
    session = json.loads(SESSION.read_text())
    found = []
    for request in session["requests"]:
        body = request["body"]
        if request["path"].startswith("/v1/messages") and body and body.get("tools"):
            found.append({**body, "model": MODEL, "max_tokens": 4, "stream": False})
    return found


def test_every_claude_code_turn_reuses_the_previous_prompt(server: Server) -> None:
    requests = claude_requests()
    # The recording holds a ToolSearch round trip: the deferred tool's reference, and
    # the tool then listed among the others.
    assert any('"tool_reference"' in json.dumps(body["messages"]) for body in requests)
    previous = None
    with httpx.Client(base_url=server.base_url, timeout=600) as client:
        for turn, body in enumerate(requests):
            reply = client.post("/v1/messages", json=body)
            assert reply.status_code == 200, (turn, reply.text)
            usage = reply.json()["usage"]
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            prompt += usage.get("cache_creation_input_tokens") or 0
            if previous is not None:
                assert usage["cache_read_input_tokens"] >= 0.95 * previous, (turn, usage)
            previous = prompt


def test_a_loaded_deferred_tool_is_written_where_it_was_loaded(server: Server) -> None:
    """The model sees the loaded tool's definition (in the tool search result), and a
    reference to a tool the request does not declare is a clear 400."""
    loading = next(b for b in claude_requests() if '"tool_reference"' in json.dumps(b))
    with httpx.Client(base_url=server.base_url, timeout=600) as client:

        def count(body: dict[str, Any]) -> httpx.Response:
            keep = ("model", "messages", "system", "tools", "thinking")
            return client.post("/v1/messages/count_tokens", json={k: body[k] for k in keep})

        with_definition = count(loading).json()["input_tokens"]
        unloaded = json.loads(json.dumps(loading).replace('"tool_reference"', '"tool_gone"'))
        refused = count(unloaded)
        assert refused.status_code == 400
        assert "tool_gone" in refused.json()["error"]["message"]
        renamed = json.dumps(loading).replace('"tool_name": "NotebookEdit"', '"tool_name": "Nope"')
        refused = count(json.loads(renamed))
        assert refused.status_code == 400
        assert "'Nope', which is not in tools" in refused.json()["error"]["message"]
        # Without the reference (a plain result), the definition is not in the prompt.
        plain = json.dumps(loading).replace(
            '[{"type": "tool_reference", "tool_name": "NotebookEdit"}]', '"loaded"'
        )
        assert plain != json.dumps(loading)
        without = count(json.loads(plain)).json()["input_tokens"]
        assert with_definition - without > 300  # NotebookEdit's schema and description
