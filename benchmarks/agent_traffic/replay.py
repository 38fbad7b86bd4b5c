"""Replay recorded agent sessions against a server: per turn TTFT, prompt tokens, and
how much of them the server reused from its prefix cache.

    .venv/bin/python benchmarks/agent_traffic/replay.py --servers omlx,mlx-lm
    .venv/bin/python benchmarks/agent_traffic/replay.py --servers rapid-mlx,rapid-mlx+chat
    .venv/bin/python benchmarks/agent_traffic/replay.py --servers omlx --tools codex \
        --sessions 1 --json-out /tmp/replay.json

Each server starts fresh (one at a time: the machine has 2 shared cores) on a model with
SmolLM2's tokenizer and chat template (so the prompts are the built-in model's: Claude
Code's first turn is 12.4k tokens) and its context raised to ``--context`` so the
agents' prompts fit: ``--shape smollm2`` is the peer benchmark's SmolLM2-135M float32
itself; ``--shape small`` (default) a random llama of 4 layers x 256, whose cold 12k
prefill takes seconds, not minutes, on a loaded 2-core machine (reuse is a property of
the prompts and the cache, not of the weights). Each tool's requests are sent in the order the
tool sent them, one at a time, as recorded, except: the model name; ``max_tokens`` set
to ``--output-tokens`` (plus ``ignore_eos`` on Chat Completions, the one API that has
it); Codex's namespace and hosted tools flattened the way issue 39 has servers treat
them. A server without the tool's API (mlx_lm.server speaks only Chat Completions) gets
the same conversation converted (to_chat.py), with the tools written into the system
message as omlx writes them for a template without tools (mlx_lm.server would drop
them: SmolLM2's template has no tools), so both compute the same prompt. Reuse of a
turn = cached prompt tokens / the previous agent turn's prompt tokens (the context the
turn extends).

``--sessions 1,2`` (default) replays every tool's session 1, then every tool's session 2
(``sessions/<tool>-2.json``: the same tool started again in the same project with a new
user message), against the one running server, as a user's day goes: the server is not
restarted between them. A later session's first agent turn extends nothing; its reuse is
cached tokens / the tokens its prompt shares with the last session's first (system
prompt and tools; shared_prefix.py counts them on the converted prompt, so a server's
own rendering of a native request can cache a few tokens more or less).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks" / "peers"))
sys.path.insert(0, str(HERE.parents[1]))
import peer_servers as ps  # noqa: E402
from run_peers import MODEL, WORK, ensure_model, make_spec  # noqa: E402

from benchmarks.agent_traffic import sessions, shared_prefix, to_chat  # noqa: E402
from benchmarks.agent_traffic.usage import read_stream  # noqa: E402

CHAT_ONLY = {"mlx-lm"}


@dataclass(slots=True)
class Turn:
    tool: str
    index: int
    kind: str  # the API the request went to
    agent: bool  # declares tools: the agent's own turn, not a side task
    ttft_s: float
    wall_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    reuse: float | None = None  # cached / previous agent turn's prompt
    session: int = 1
    # A later session's first agent turn: the tokens its prompt shares with the last
    # session's first (system prompt and tools), and cached / those.
    shared_tokens: int | None = None
    shared_reuse: float | None = None


def prepared(request: dict[str, Any], model: str, out_tokens: int, chat_only: bool) -> tuple:
    """(path, body) to send for a recorded request."""
    kind, body = request["kind"], {**request["body"], "model": model}
    if chat_only:
        body, kind = to_chat.request_as_chat(kind, body), "chat"
    elif kind == "responses":
        body["tools"] = to_chat.flat_tools(body.get("tools") or [])
    body["stream"] = True
    if kind == "chat":
        body.update(max_tokens=out_tokens, ignore_eos=True, stream_options={"include_usage": True})
        body.pop("max_completion_tokens", None)
    elif kind == "anthropic":
        body["max_tokens"] = out_tokens
    else:
        body["max_output_tokens"] = out_tokens
    path = {v: k for k, v in sessions.ENDPOINTS.items()}[kind]
    return kind, path, body


def replay_tool(
    client: httpx.Client,
    tool: str,
    session: int,
    model: str,
    args: argparse.Namespace,
    chat_only: bool,
) -> list[Turn]:
    turns: list[Turn] = []
    previous_prompt: int | None = None
    shared = args.shared.get(tool) if session > 1 else None
    for index, request in enumerate(sessions.model_requests(sessions.load(tool, session))):
        kind, path, body = prepared(request, model, args.output_tokens, chat_only)
        started = time.perf_counter()
        with client.stream("POST", path, json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(
                    f"{tool} turn {index}: {reply.status_code} {reply.read()[:600]!r}"
                )
            seen = read_stream(kind, reply.iter_lines(), started)
        turn = Turn(
            tool,
            index,
            kind,
            bool(request["body"].get("tools")),
            seen.ttft_s,
            time.perf_counter() - started,
            seen.prompt_tokens,
            seen.cached_tokens,
            seen.output_tokens,
            session=session,
        )
        if turn.agent:
            if previous_prompt and turn.cached_tokens is not None:
                turn.reuse = turn.cached_tokens / previous_prompt
            elif shared and turn.cached_tokens is not None:
                turn.shared_tokens, turn.shared_reuse = shared, turn.cached_tokens / shared
            previous_prompt = turn.prompt_tokens
        turns.append(turn)
        print(
            f"  {tool} s{session} #{index} {kind}: ttft {turn.ttft_s:.2f}s prompt "
            f"{turn.prompt_tokens} cached {turn.cached_tokens} reuse {turn.reuse} "
            f"shared reuse {turn.shared_reuse}",
            flush=True,
        )
    return turns


def warm_up(client: httpx.Client, model: str) -> None:
    """One short chat request before the sessions, to every server alike: omlx answers
    /health while its model still loads in the background (the architecture probe, the
    load and the memory profile: ~30 s on a loaded 2-core machine), and that load would
    otherwise land on the first recorded turn; mlx_lm.server loads before it listens."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    client.post("/v1/chat/completions", json=body).raise_for_status()


def run_server(name: str, models: Path, args: argparse.Namespace) -> list[Turn]:
    """``name`` is a server; ``<server>+chat`` sends it every request as Chat Completions
    with the tools in the system message (the same prompt text for every server)."""
    server_name, _, mode = name.partition("+")
    chat_only = server_name in CHAT_ONLY or mode == "chat"
    spec = make_spec(server_name, models, ps.free_port(), args.peer_venvs, "same-fast")
    log = Path(tempfile.mkdtemp(prefix=f"replay-{name}-")) / "server.log"
    server = ps.RunningServer(spec, log, timeout_s=600)
    print(f"{name}: log {log}", flush=True)
    try:
        base = f"http://127.0.0.1:{spec.port}"
        with httpx.Client(base_url=base, timeout=httpx.Timeout(1800, connect=10)) as client:
            warm_up(client, spec.model)
            turns = []
            # Every tool's session 1, then every tool's session 2, against the one
            # running server: a user's day, the server never restarted between them.
            for session in args.sessions:
                for tool in args.tools.split(","):
                    turns += replay_tool(client, tool, session, spec.model, args, chat_only)
            return turns
    finally:
        server.stop()


def summary(turns: list[Turn]) -> dict[str, Any]:
    """Totals over all turns, and per session under ``sessions``."""
    found = totals(turns)
    numbers = sorted({t.session for t in turns})
    if len(numbers) > 1:
        found["sessions"] = {n: totals([t for t in turns if t.session == n]) for n in numbers}
    return found


def totals(turns: list[Turn]) -> dict[str, Any]:
    agent = [t for t in turns if t.agent]
    later = [t for t in agent if t.reuse is not None]
    prompt = sum(t.prompt_tokens or 0 for t in turns)
    cached = sum(t.cached_tokens or 0 for t in turns)
    return {
        "wall_s": round(sum(t.wall_s for t in turns), 2),
        "ttft_sum_s": round(sum(t.ttft_s for t in turns), 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "min_reuse": round(min((t.reuse for t in later), default=0.0), 4),
    }


def shared_tokens(tools: list[str]) -> dict[str, int]:
    """Per tool, the prompt tokens session 2's first agent turn shares with session 1's."""
    tokenizer = shared_prefix.load_tokenizer()
    found = {}
    for tool in tools:
        check = shared_prefix.compare(tool, tokenizer)
        print("shared prefix:", json.dumps(check), flush=True)
        found[tool] = check["shared_tokens"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="omlx,mlx-lm")
    parser.add_argument("--tools", default=",".join(sessions.TOOLS))
    parser.add_argument(
        "--sessions",
        default="1,2",
        help="recorded sessions to replay, in order, against one running server",
    )
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument(
        "--shape",
        choices=["small", "smollm2"],
        default="small",
        help="smollm2: the built-in model; small: a random 4-layer llama with its tokenizer",
    )
    parser.add_argument("--peer-venvs", type=Path, default=WORK / "venvs")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    args.sessions = [int(n) for n in args.sessions.split(",")]
    args.shared = shared_tokens(args.tools.split(",")) if max(args.sessions) > 1 else {}
    base_models = ensure_model(WORK / "base")
    models = WORK / f"agent-models-{args.shape}-{args.context}"
    if args.shape == "smollm2":
        sessions.long_context_copy(base_models / MODEL, models / MODEL, args.context)
    else:
        sessions.small_random_copy(base_models / MODEL, models / MODEL, args.context)
    results: dict[str, Any] = {}
    for name in args.servers.split(","):
        turns = run_server(name, models, args)
        results[name] = {"summary": summary(turns), "turns": [asdict(t) for t in turns]}
        print(name, json.dumps(results[name]["summary"]), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
