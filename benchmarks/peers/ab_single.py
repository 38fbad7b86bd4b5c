"""Decode throughput, interleaved: omlx against peers, round by round.

The peer table runs one server at a time, minutes apart; on a shared 2-core VM the
host drifts by +-10-15% between them, as much as the differences in the decode
rows. Here every server is started at once (idle servers only hold memory), warmed
with one request (and, with ``--streams``, one round of that many streams), and
then sent one round each in turn, the order rotating every pair, so each pair is
measured within seconds. A round is one streaming request (single-stream decode
tok/s), or with ``--streams N`` N concurrent requests: the peer table's aggregate
row (completion tokens of all N over the wall time from the first send to the
last token, so the N first tokens' wait counts).

    .venv/bin/python benchmarks/peers/ab_single.py --servers omlx,rapid-mlx --pairs 8
    .venv/bin/python benchmarks/peers/ab_single.py --servers omlx,mlx-lm --streams 8
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
from peer_client import PeerClient, nonce
from prompts import decode_messages
from run_peers import BLAS_MODES, MODEL, WORK, ensure_model, make_spec


async def one(base_url: str, model: str, tokens: int) -> float:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        r = await PeerClient(http, model).chat(decode_messages(0, nonce()), tokens)
    return (r.completion_tokens - 1) / r.decode_s


async def many(base_url: str, model: str, tokens: int, streams: int) -> float:
    """Aggregate tok/s of ``streams`` concurrent requests (as peer_client's row)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        client, tag = PeerClient(http, model), nonce()
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(client.chat(decode_messages(i, tag), tokens) for i in range(streams))
        )
        return sum(r.completion_tokens for r in runs) / (time.perf_counter() - start)


def round_of(server: ps.RunningServer, tokens: int, streams: int) -> float:
    base_url, model = server.spec.base_url, server.spec.model
    if streams > 1:
        return asyncio.run(many(base_url, model, tokens, streams))
    return asyncio.run(one(base_url, model, tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="omlx,rapid-mlx", help="comma list, omlx first")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=1, help="concurrent requests per round")
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
            if args.streams > 1:
                round_of(server, 8, args.streams)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.pairs):
            order = running[i % len(running) :] + running[: i % len(running)]
            for server in order:
                rates[server.spec.name].append(round_of(server, args.tokens, args.streams))
        first = names[0]
        what = f"rounds of {args.streams} streams" if args.streams > 1 else "requests"
        print(f"{MODEL}, {args.tokens} tokens, {args.pairs} interleaved {what} per server")
        for name in names:
            values = " ".join(f"{v:.1f}" for v in rates[name])
            print(f"{name:10s} median {statistics.median(rates[name]):6.2f} tok/s   {values}")
        for name in names[1:]:
            ratios = [a / b for a, b in zip(rates[first], rates[name], strict=True)]
            print(
                f"{first}/{name}: median of per-pair ratios {statistics.median(ratios):.3f} "
                f"({' '.join(f'{r:.2f}' for r in ratios)})"
            )
    finally:
        for server in running:
            server.stop()


if __name__ == "__main__":
    main()
