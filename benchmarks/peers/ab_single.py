"""Interleaved A/B: omlx against peers (or omlx against itself), round by round.

The peer table runs one server at a time, minutes apart; on a shared 2-core VM the
host drifts by +-10-15% between them, as much as the differences in the decode
rows. Here every server is started at once (idle servers only hold memory), warmed
with one request (and one round of the workload), and then sent one round each in
turn, the order rotating every pair, so each pair is measured within seconds. A round
is one of:

- one streaming request: single-stream decode tok/s and TTFT;
- ``--streams N``: N concurrent requests, the peer table's aggregate row (completion
  tokens of all N over the wall time from the first send to the last token, so the N
  first tokens' wait counts) and their mean TTFT;
- ``--agent``: one agent session (peer_client.agent_session): its wall time and mean TTFT.

``omlx:<strategy>`` names omlx with that ``scheduler.execution_strategy``, ``omlx@REV``
the code of commit REV (the step redesign's before/after: ``omlx@b66bb0a,omlx``).

    .venv/bin/python benchmarks/peers/ab_single.py --servers omlx,rapid-mlx --pairs 8
    .venv/bin/python benchmarks/peers/ab_single.py --servers omlx,mlx-lm --streams 8
    .venv/bin/python benchmarks/peers/ab_single.py --servers omlx,mlx-lm --agent --pairs 3
    .venv/bin/python benchmarks/peers/ab_single.py --servers omlx:fast_paths,omlx:plain
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_servers as ps
from peer_client import Config, PeerClient, agent_session, nonce
from prompts import decode_messages
from run_peers import BLAS_MODES, MODEL, WORK, ensure_model, make_spec

HIGHER_IS_BETTER = {"tok_s"}


async def one(base_url: str, model: str, tokens: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        r = await PeerClient(http, model).chat(decode_messages(0, nonce()), tokens)
    return {"tok_s": (r.completion_tokens - 1) / r.decode_s, "ttft_s": r.ttft_s}


async def many(base_url: str, model: str, tokens: int, streams: int) -> dict[str, float]:
    """Aggregate tok/s of ``streams`` concurrent requests (as peer_client's row)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        client, tag = PeerClient(http, model), nonce()
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(client.chat(decode_messages(i, tag), tokens) for i in range(streams))
        )
        wall_s = time.perf_counter() - start
    return {
        "tok_s": sum(r.completion_tokens for r in runs) / wall_s,
        "ttft_mean_s": statistics.fmean(r.ttft_s for r in runs),
    }


async def agent(base_url: str, model: str, cfg: Config) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as http:
        wall_s, runs = await agent_session(PeerClient(http, model), cfg)
    return {"wall_s": wall_s, "ttft_mean_s": statistics.fmean(r.ttft_s for r in runs)}


def round_of(
    server: ps.RunningServer, args: argparse.Namespace, warm: bool, session: str = ""
) -> dict[str, float]:
    """One round on ``server``; ``session`` names an agent session (the pair's)."""
    base_url, model = server.spec.base_url, server.spec.model
    tokens = 8 if warm else args.tokens
    if args.agent:
        cfg = Config(agent_turns=2 if warm else args.turns, agent_session=session)
        return asyncio.run(agent(base_url, model, cfg))
    if args.streams > 1:
        return asyncio.run(many(base_url, model, tokens, args.streams))
    return asyncio.run(one(base_url, model, tokens))


def strategies(server: ps.RunningServer) -> list[object]:
    """The execution strategies omlx's /health reports (its models' load facts)."""
    found: list[object] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "execution_strategy":
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(httpx.get(f"http://127.0.0.1:{server.spec.port}/health", timeout=30).json())
    return found


def report(args: argparse.Namespace, names: list[str], rounds: dict[str, list[dict]]) -> None:
    if args.agent:
        what = f"agent sessions of {args.turns} turns"
    elif args.streams > 1:
        what = f"rounds of {args.streams} streams, {args.tokens} tokens"
    else:
        what = f"requests of {args.tokens} tokens"
    print(f"{MODEL}, {args.pairs} interleaved {what} per server")
    first = names[0]
    for metric in rounds[first][0]:
        better = "higher" if metric in HIGHER_IS_BETTER else "lower"
        print(f"\n{metric} ({better} is better)")
        for name in names:
            values = [r[metric] for r in rounds[name]]
            shown = " ".join(f"{v:.3g}" for v in values)
            print(f"  {name:18s} median {statistics.median(values):8.3f}   {shown}")
        for name in names[1:]:
            pairs = zip(rounds[first], rounds[name], strict=True)
            ratios = [a[metric] / b[metric] for a, b in pairs]
            print(
                f"  {first}/{name}: median of per-pair ratios {statistics.median(ratios):.3f} "
                f"({' '.join(f'{r:.2f}' for r in ratios)})"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="omlx,rapid-mlx", help="comma list, omlx first")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=1, help="concurrent requests per round")
    ap.add_argument("--agent", action="store_true", help="a round is one agent session")
    ap.add_argument("--turns", type=int, default=10, help="turns of an --agent session")
    ap.add_argument("--peer-venvs", type=Path, default=Path("/tmp/omlx-peers/venvs"))
    ap.add_argument("--blas", choices=list(BLAS_MODES), default="same-fast", help="as run_peers")
    args = ap.parse_args()
    names = args.servers.split(",")
    # The model run_peers.py imports (kept for the next run); server logs under WORK/logs.
    models = ensure_model(WORK / "base")
    logs = WORK / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    running = []
    try:
        for name in names:
            spec = make_spec(name, models, ps.free_port(), args.peer_venvs, args.blas)
            running.append(ps.RunningServer(spec, logs / f"ab-{name}.log"))
        for server in running:  # warm-up: model load, first kernels (and batch sizes)
            asyncio.run(one(server.spec.base_url, server.spec.model, 8))
            round_of(server, args, warm=True)
            if server.spec.name.startswith("omlx"):
                print(f"{server.spec.name}: execution_strategy {strategies(server)}", flush=True)
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for i in range(args.pairs):
            order = running[i % len(running) :] + running[: i % len(running)]
            session = f"{nonce()}-pair{i + 1}"  # the same agent session for each server
            for server in order:
                rounds[server.spec.name].append(round_of(server, args, False, session))
        report(args, names, rounds)
    finally:
        for server in running:
            server.stop()


if __name__ == "__main__":
    main()
