"""Cold long-prompt prefill: TTFT of omlx, mlx_lm.server and mlx-lm's own
``stream_generate`` in process, on one agent's first prompt, interleaved.

    .venv/bin/python benchmarks/agent_traffic/cold_prefill.py --rounds 4
    .venv/bin/python benchmarks/agent_traffic/cold_prefill.py --tool codex \
        --omlx-env OMLX_SCHEDULER__PREFILL_STEP_SIZE=2048

Both servers run at once on the replay's ``--shape small`` model (replay.py builds it)
and get the same Chat Completions request: the tool's first agent turn converted as the
replay converts it for mlx_lm.server (tools in the system message), so every side
computes the same prompt. Each round starts the system message with a new nonce, so no
prefix cache holds any of it (only the template's few opening tokens); one answer token.
Each side answers one short warm-up request first (replay.warm_up: omlx loads its model
in the background after it starts listening).
The order of the three sides rotates each round (the machine is shared: host drift
cancels in the per-round ratios). In process: the prompt's token ids through mlx-lm's
``stream_generate`` (prefill_step_size 2048, its default), timed to its first response.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks" / "peers"))
sys.path.insert(0, str(HERE.parents[1]))
import peer_servers as ps  # noqa: E402
from run_peers import MODEL, WORK, ensure_model, make_spec  # noqa: E402

from benchmarks.agent_traffic import sessions  # noqa: E402
from benchmarks.agent_traffic.replay import prepared, warm_up  # noqa: E402
from benchmarks.agent_traffic.usage import read_stream  # noqa: E402


def first_prompt(tool: str) -> dict[str, Any]:
    """The tool's first agent turn as a Chat Completions body, tools in the system."""
    for request in sessions.model_requests(sessions.load(tool)):
        if request["body"].get("tools"):
            return prepared(request, "model", 1, chat_only=True)[2]
    raise SystemExit(f"{tool}: no agent turn")


def with_nonce(body: dict[str, Any], nonce: str) -> dict[str, Any]:
    messages = [dict(m) for m in body["messages"]]
    messages[0]["content"] = f"[{nonce}] " + messages[0]["content"]
    return {**body, "messages": messages}


def ask(client: httpx.Client, body: dict[str, Any]) -> tuple[float, int]:
    started = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code} {reply.read()[:400]!r}")
        seen = read_stream("chat", reply.iter_lines(), started)
    return seen.ttft_s, seen.prompt_tokens or 0


class InProcess:
    """mlx-lm's own generation loop on the same model and prompt."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load, stream_generate

        self.model, self.tokenizer = load(str(model_dir))
        for _ in stream_generate(self.model, self.tokenizer, "hi", max_tokens=1):
            break  # warmed up as the servers are

    def ttft(self, body: dict[str, Any]) -> tuple[float, int]:
        import mlx.core as mx
        from mlx_lm import stream_generate

        ids = self.tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True
        )
        mx.clear_cache()
        started = time.perf_counter()
        for _ in stream_generate(self.model, self.tokenizer, ids, max_tokens=1):
            break
        return time.perf_counter() - started, len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", default="claude", choices=sessions.TOOLS)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--sides", default="omlx,mlx-lm,in-process")
    parser.add_argument("--omlx-env", action="append", default=[], help="KEY=VALUE for omlx")
    args = parser.parse_args()
    models = WORK / f"agent-models-small-{args.context}"
    sessions.small_random_copy(ensure_model(WORK / "base") / MODEL, models / MODEL, args.context)
    body = first_prompt(args.tool)
    sides = args.sides.split(",")
    servers: dict[str, tuple[ps.RunningServer, httpx.Client, str]] = {}
    local = InProcess(models / MODEL) if "in-process" in sides else None
    try:
        for name in (s for s in sides if s != "in-process"):
            servers[name] = start(name, models, args.omlx_env)
        rounds = run_rounds(args.rounds, sides, body, servers, local)
    finally:
        for server, client, _ in servers.values():
            client.close()
            server.stop()
    report(sides, rounds)


def start(name: str, models: Path, omlx_env: list[str]) -> tuple:
    """(server, client, model name), the server warmed up."""
    spec = make_spec(name, models, ps.free_port(), WORK / "venvs", "same-fast")
    if name == "omlx":
        spec.env.update(kv.split("=", 1) for kv in omlx_env)
    log = Path(tempfile.mkdtemp(prefix=f"cold-{name}-")) / "server.log"
    print(f"{name}: log {log}", flush=True)
    server = ps.RunningServer(spec, log, timeout_s=600)
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{spec.port}", timeout=httpx.Timeout(1800, connect=10)
    )
    try:
        warm_up(client, spec.model)
    except Exception:
        client.close()
        server.stop()
        raise
    return server, client, spec.model


def run_rounds(num_rounds, sides, body, servers, local) -> list[dict[str, float]]:
    rounds = []
    for rnd in range(num_rounds):
        order = sides[rnd % len(sides) :] + sides[: rnd % len(sides)]
        times: dict[str, float] = {}
        for side in order:
            nonced = with_nonce(body, uuid.uuid4().hex)
            if side == "in-process":
                times[side], tokens = local.ttft(nonced)
            else:
                _, client, model = servers[side]
                times[side], tokens = ask(client, {**nonced, "model": model})
            print(f"  round {rnd} {side}: ttft {times[side]:.2f}s, {tokens} prompt tokens")
        rounds.append(times)
    return rounds


def report(sides: list[str], rounds: list[dict[str, float]]) -> None:
    print(f"load average {os.getloadavg()}")
    for side in sides:
        values = [r[side] for r in rounds]
        print(
            f"{side}: median {statistics.median(values):.2f}s, "
            + " ".join(f"{v:.2f}" for v in values)
        )
    for side in sides[1:]:
        ratios = [r[side] / r[sides[0]] for r in rounds]
        print(
            f"{side} / {sides[0]}: median {statistics.median(ratios):.3f} "
            f"(per round {' '.join(f'{x:.2f}' for x in ratios)})"
        )


if __name__ == "__main__":
    main()
