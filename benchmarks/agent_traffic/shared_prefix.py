"""How much of a tool's first request session 2 shares with session 1's.

    .venv/bin/python benchmarks/agent_traffic/shared_prefix.py [TOOL ...]

A user starts the same agent again in the same project with a new question: the first
agent request of the new session should carry the same system prompt and tool list as
the last session's, and only the user's message (at the end) differs. This checks it on
the recordings (system prompt and tools byte for byte) and counts the shared prefix in
tokens: both requests converted to Chat Completions with the tools in the system message
(what the replay's converted mode sends), rendered by SmolLM2's chat template and
tokenizer, and compared token by token. Those are the tokens a prefix cache can reuse on
the new session's first turn.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks" / "peers"))
sys.path.insert(0, str(HERE.parents[1]))
from run_peers import MODEL, WORK, ensure_model  # noqa: E402

from benchmarks.agent_traffic import sessions, to_chat  # noqa: E402
from omlx.cache.prefix_index import common_prefix  # noqa: E402


def system_text(kind: str, body: dict[str, Any]) -> Any:
    """The tool's system prompt as sent, wherever its API puts it."""
    if kind == "anthropic":
        return body.get("system")
    if kind == "responses":
        return body.get("instructions")
    return [m for m in body.get("messages") or [] if m.get("role") == "system"]


def prompt_ids(tokenizer: Any, request: dict[str, Any]) -> list[int]:
    chat = to_chat.request_as_chat(request["kind"], request["body"])
    text = tokenizer.apply_chat_template(
        chat["messages"], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def compare(tool: str, tokenizer: Any) -> dict[str, Any]:
    """Session 1 against session 2: the first agent request of each."""
    first = [sessions.first_agent_request(sessions.load(tool, number)) for number in (1, 2)]
    ids = [prompt_ids(tokenizer, r) for r in first]
    kind = first[0]["kind"]
    return {
        "tool": tool,
        "same_system": system_text(kind, first[0]["body"]) == system_text(kind, first[1]["body"]),
        "same_tools": first[0]["body"].get("tools") == first[1]["body"].get("tools"),
        "prompt_tokens": [len(i) for i in ids],
        "shared_tokens": common_prefix(*ids),
    }


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_model(WORK / "base") / MODEL))


def main() -> None:
    tokenizer = load_tokenizer()
    for tool in sys.argv[1:] or sessions.TOOLS:
        print(json.dumps(compare(tool, tokenizer)))


if __name__ == "__main__":
    main()
