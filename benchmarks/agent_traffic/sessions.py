"""The recorded sessions: loading them, and the model-serving requests in them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

SESSIONS = Path(__file__).resolve().parent / "sessions"
TOOLS = ("claude", "codex", "opencode")
# Recorded path -> what kind of API it is (the query string is dropped).
ENDPOINTS = {
    "/v1/messages": "anthropic",
    "/v1/responses": "responses",
    "/v1/chat/completions": "chat",
}


def path(tool: str, session: int = 1) -> Path:
    """Session 1 is ``<tool>.json`` (the first recording); session n, ``<tool>-<n>.json``:
    the same tool started again in the same project with another user message."""
    return SESSIONS / (f"{tool}.json" if session == 1 else f"{tool}-{session}.json")


def load(tool: str, session: int = 1) -> dict[str, Any]:
    return json.loads(path(tool, session).read_text())


def model_requests(session: dict[str, Any]) -> list[dict[str, Any]]:
    """The POSTs that ask the model for an answer, in the order the tool sent them."""
    found = []
    for request in session["requests"]:
        path = request["path"].split("?")[0]
        if request["method"] == "POST" and path in ENDPOINTS:
            found.append({**request, "path": path, "kind": ENDPOINTS[path]})
    return found


def first_agent_request(session: dict[str, Any]) -> dict[str, Any]:
    """The first request that declares tools: the agent's own turn, not a title task."""
    return next(r for r in model_requests(session) if r["body"].get("tools"))


def long_context_copy(model_dir: Path, target: Path, context: int) -> Path:
    """``model_dir`` with ``max_position_embeddings`` raised to ``context``: the same
    weights and compute shape, so a server accepts an agent's long prompt (the text the
    model writes past its trained length is garbage, which a benchmark does not read)."""
    if not (target / "config.json").exists():
        shutil.copytree(model_dir, target, symlinks=True, dirs_exist_ok=True)
        config = json.loads((target / "config.json").read_text())
        config["max_position_embeddings"] = context
        (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


SMALL_SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def small_random_copy(model_dir: Path, target: Path, context: int) -> Path:
    """A random llama of SMALL_SHAPE with ``model_dir``'s tokenizer and chat template."""
    if not (target / "config.json").exists():
        from tests.fixtures.tiny_models import build_tiny_model

        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        overrides = {**SMALL_SHAPE, "vocab_size": vocab, "max_position_embeddings": context}
        build_tiny_model(target, "llama", **overrides)
        for name in TOKENIZER_FILES:
            shutil.copy(model_dir / name, target / name)
    return target
