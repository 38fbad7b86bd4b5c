"""Measure each agent's first request (bytes and prompt tokens) into omlx/data.

    .venv/bin/python benchmarks/agent_traffic/first_requests.py

The recorded first agent turn (the first request declaring tools) of each session is
counted by a live omlx serving the built-in SmolLM2 (context raised so any prompt fits):
Claude Code's through /v1/messages/count_tokens, Codex's through
/v1/responses/input_tokens, opencode's as a one-token chat completion (prompt_tokens).
The count includes the tool declarations as omlx renders them into the prompt. Other
tokenizers are listed when a model folder for them is given (--model NAME=DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks" / "peers"))
sys.path.insert(0, str(HERE.parents[1]))
import peer_servers as ps  # noqa: E402
from run_peers import MODEL, WORK, ensure_model  # noqa: E402

from benchmarks.agent_traffic import sessions  # noqa: E402
from benchmarks.agent_traffic.to_chat import flat_tools  # noqa: E402

OUT = HERE.parents[1] / "omlx" / "data" / "agent_first_requests.json"


def count(client: httpx.Client, kind: str, body: dict[str, Any]) -> int:
    if kind == "anthropic":
        keep = ("model", "messages", "system", "tools", "tool_choice", "thinking")
        reply = client.post(
            "/v1/messages/count_tokens", json={k: body[k] for k in keep if k in body}
        )
        reply.raise_for_status()
        return int(reply.json()["input_tokens"])
    if kind == "responses":
        body = {**body, "tools": flat_tools(body.get("tools", [])), "stream": False}
        reply = client.post("/v1/responses/input_tokens", json=body)
        reply.raise_for_status()
        return int(reply.json()["input_tokens"])
    plain = {**body, "stream": False, "max_tokens": 1}
    plain.pop("stream_options", None)
    reply = client.post("/v1/chat/completions", json=plain)
    reply.raise_for_status()
    return int(reply.json()["usage"]["prompt_tokens"])


def measure(model_dir: Path, model: str) -> dict[str, int]:
    """Prompt tokens of each tool's first request, counted by omlx serving ``model``."""
    spec = ps.omlx_spec(model_dir, model, ps.free_port())
    log = Path(tempfile.mkdtemp(prefix="agent-first-")) / "omlx.log"
    server = ps.RunningServer(spec, log)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{spec.port}", timeout=600) as client:
            found = {}
            for tool in sessions.TOOLS:
                first = sessions.first_agent_request(sessions.load(tool))
                found[tool] = count(client, first["kind"], {**first["body"], "model": model})
            return found
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=[], help="NAME=DIR, more tokenizers")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    models_dir = ensure_model(WORK / "base")
    long_dir = Path(tempfile.mkdtemp(prefix="agent-first-models-"))
    sessions.long_context_copy(models_dir / MODEL, long_dir / MODEL, 131072)
    tokenizers = {MODEL: (long_dir, MODEL)}
    for item in args.model:
        name, _, folder = item.partition("=")
        tokenizers[name] = (Path(folder).parent, Path(folder).name)
    counts = {name: measure(folder, model) for name, (folder, model) in tokenizers.items()}
    data: dict[str, Any] = {
        "about": "Each agent's first request (its first turn with tools), as recorded in "
        "benchmarks/agent_traffic/sessions; tokens as omlx renders it (tools included) "
        "with each named model's tokenizer and chat template.",
        "tools": {},
    }
    for tool in sessions.TOOLS:
        session = sessions.load(tool)
        first = sessions.first_agent_request(session)
        data["tools"][tool] = {
            "version": session.get("version", ""),
            "endpoint": first["path"],
            "bytes": len(json.dumps(first["body"], separators=(",", ":")).encode()),
            "tokens": {name: counts[name][tool] for name in counts},
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
