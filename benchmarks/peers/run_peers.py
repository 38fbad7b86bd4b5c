"""Peer comparison: omlx vs mlx_lm.server (and other MLX servers) on the same model.

    .venv/bin/python benchmarks/peers/run_peers.py                 # 2 rounds, full rows
    .venv/bin/python benchmarks/peers/run_peers.py --quick         # 1 round, short rows
    .venv/bin/python benchmarks/peers/run_peers.py --servers omlx,mlx-lm,vllm-mlx \
        --install-peers --rounds 3 --json-out /tmp/peers.json
    .venv/bin/python benchmarks/peers/run_peers.py --rows single,c8,agent   # some rows only

Imports SmolLM2-135M-Instruct float32 (``omlx models install-default``) into a temp
base path, then for each round starts one server at a time (never two together on the
2 shared cores), runs peer_client.measure against it, and stops it. The side that goes
first rotates each round. Prints one table: the median over rounds per server, the best
peer, omlx / best peer, and each round's values. Targets are reported, never enforced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import peer_servers as ps
from flood_realistic import extract_ref
from peer_client import ROW_GROUPS, Config, measure, nonce, parse_groups

MODEL = "SmolLM2-135M-Instruct"
WORK = Path(tempfile.gettempdir()) / "omlx-peers"
PYPI_PEERS = {"vllm-mlx": "vllm-mlx", "rapid-mlx": "rapid-mlx"}
HIGHER, LOWER = "higher", "lower"
# Which servers run omlx's small-batch matmul (omlx/native/fastgemm.c) in front of
# OpenBLAS; the others get OpenBLAS alone. The "same-*" modes give every server the same
# BLAS, so the table compares server designs; "shipped" is each server as its own setup
# leaves it (plus OpenBLAS for the peers).
BLAS_MODES = {
    "same-fast": {"omlx", "mlx-lm", "rapid-mlx", "vllm-mlx"},
    "shipped": {"omlx"},
    "same-openblas": set(),
}
# key, label, better, target advantage over the best peer (issue 9)
ROWS = [
    ("single_tok_s", "single-stream decode tok/s", HIGHER, 1.0),
    ("single_ttft_s", "single-stream TTFT s", LOWER, 1.0),
    ("c8_tok_s", "aggregate tok/s, 8 streams", HIGHER, 1.3),
    ("c8_ttft_mean_s", "TTFT mean s, 8 streams", LOWER, 1.0),
    ("c8_ttft_p99_s", "TTFT p99 s, 8 streams", LOWER, 1.0),
    ("c16_tok_s", "aggregate tok/s, 16 streams", HIGHER, 1.0),
    ("c16_ttft_mean_s", "TTFT mean s, 16 streams", LOWER, 1.0),
    ("c16_ttft_p99_s", "TTFT p99 s, 16 streams", LOWER, 1.0),
    ("long_cold_ttft_s", "TTFT long prompt, cold s", LOWER, 1.0),
    ("long_hit_ttft_s", "TTFT long prompt, repeated s", LOWER, 1.0),
    ("long_partial_ttft_s", "TTFT long prompt + new turn s", LOWER, 1.3),
    ("agent_wall_s", "agent session 10 turns, wall s", LOWER, 1.5),
    ("agent_ttft_mean_s", "agent session TTFT mean s", LOWER, 1.0),
    ("peak_rss_mb", "server peak RSS MB", LOWER, 1.0),
]


def ensure_model(base: Path) -> Path:
    """The built-in model imported from its GGUF as float32; returns its models dir."""
    models = base / "models"
    if not (models / MODEL / "config.json").exists():
        cmd = [str(ps.VENV_BIN / "omlx"), "--base-path", str(base), "models", "install-default"]
        subprocess.run(cmd, check=True)
    return models


def ref_tree(rev: str) -> Path:
    """Commit ``rev``'s code, extracted once under WORK/trees."""
    tree = WORK / "trees" / rev
    return tree if tree.is_dir() else extract_ref(rev, tree)


def make_spec(name: str, models: Path, port: int, venvs: Path, blas: str) -> ps.ServerSpec:
    """``name`` is a server; ``omlx:<strategy>`` is omlx with that
    ``scheduler.execution_strategy`` (auto, plain, fast_paths), and ``omlx@REV`` runs
    the code of commit REV (``git archive``), for A/Bs of omlx itself."""
    server, _, strategy = name.partition(":")
    server, _, rev = server.partition("@")
    if server == "omlx":
        spec = ps.omlx_spec(models, MODEL, port, tree=ref_tree(rev) if rev else None)
        spec.name = name
        if strategy:
            spec.env["OMLX_SCHEDULER__EXECUTION_STRATEGY"] = strategy
    elif name == "mlx-lm":
        spec = ps.mlx_lm_spec(models / MODEL, port)
    elif name == "vllm-mlx":
        spec = ps.vllm_mlx_spec(venvs / name, models / MODEL, port)
    elif name == "rapid-mlx":
        spec = ps.rapid_mlx_spec(venvs / name, models / MODEL, port)
    else:
        raise SystemExit(f"unknown server {name!r}")
    if server not in BLAS_MODES[blas]:
        spec.env["OMLX_FASTGEMM"] = "0"  # the shared library forwards every call to OpenBLAS
    return spec


def run_one(spec: ps.ServerSpec, cfg: Config, log: Path) -> dict:
    server = ps.RunningServer(spec, log)
    try:
        rep = asyncio.run(measure(spec.base_url, spec.model, cfg, server.proc.pid))
    except Exception as exc:  # any client failure marks this server, not the whole run
        raise ps.ServerFailed(f"{spec.name}: {exc!r}; log: {server.tail(800)}") from exc
    finally:
        server.stop()
    return asdict(rep)


def run_rounds(args: argparse.Namespace, models: Path, cfg: Config) -> tuple[dict, dict]:
    """results[server] = list of per-round reports; failures[server] = reason."""
    results: dict[str, list[dict]] = {name: [] for name in args.servers}
    failures: dict[str, str] = {}
    for rnd in range(args.rounds):
        # One agent session id per round: the same bytes to every server, each cold on
        # it (every start gets a fresh base path or HOME; mlx-lm's cache is in memory).
        cfg = replace(cfg, agent_session=f"{nonce()}-round{rnd + 1}")
        shift = rnd % len(args.servers)
        order = args.servers[shift:] + args.servers[:shift]
        for name in order:
            if name in failures:
                continue
            log = WORK / "logs" / f"{name}-round{rnd + 1}.log"
            print(f"round {rnd + 1}: {name} ...", flush=True)
            try:
                spec = make_spec(name, models, ps.free_port(), args.peer_venvs, args.blas)
                results[name].append(run_one(spec, cfg, log))
            except (ps.ServerFailed, OSError) as exc:
                failures[name] = str(exc)
                print(f"  {name} failed: {str(exc)[:600]}", flush=True)
            save(args.json_out, results, failures)  # a long run that stops keeps its rounds
    return results, failures


def save(path: Path | None, results: dict, failures: dict) -> None:
    if path:
        path.write_text(json.dumps({"results": results, "failures": failures}, indent=1))


def medians(reports: list[dict]) -> dict[str, float]:
    keys = reports[0]["metrics"].keys() if reports else []
    return {k: statistics.median(r["metrics"][k] for r in reports) for k in keys}


def print_table(results: dict[str, list[dict]]) -> None:
    names = [n for n, reps in results.items() if reps]
    med = {n: medians(results[n]) for n in names}
    peers = [n for n in names if n != "omlx"]
    head = f"{'metric':32}" + "".join(f"{n:>11}" for n in names)
    print(head + f"{'best peer':>11}{'omlx/best':>10}{'target':>8}  omlx | best peer per round")
    for key, label, better, target in ROWS:
        if "omlx" not in med or key not in med["omlx"] or not peers:
            continue
        pick = max if better == HIGHER else min
        best = pick(peers, key=lambda n: med[n][key])
        ratio = med["omlx"][key] / med[best][key]
        goal = target if better == HIGHER else 1 / target
        ok = ratio >= goal if better == HIGHER else ratio <= goal
        sign = ">=" if better == HIGHER else "<="
        rounds = " ".join(f"{r['metrics'][key]:.3g}" for r in results["omlx"])
        rounds += " | " + " ".join(f"{r['metrics'][key]:.3g}" for r in results[best])
        cells = "".join(f"{med[n][key]:11.3f}" for n in names)
        verdict = f"{sign}{goal:.2f} {'ok' if ok else 'MISS'}"
        print(f"{label:32}{cells}{best:>11}{ratio:10.2f}  {verdict:10}  {rounds}")


def print_tokens(results: dict[str, list[dict]]) -> None:
    print("\ncompletion tokens per row (min-max over streams and rounds); long-prompt tokens:")
    for name, reps in results.items():
        if not reps:
            continue
        spans = []
        for row in reps[0]["tokens"]:
            counts = [c for r in reps for c in r["tokens"][row]]
            spans.append(f"{row} {min(counts)}-{max(counts)}")
        long = reps[0]["prompt_tokens"]
        cached = reps[0]["cached_tokens"]
        retries = sum(r["retries"] for r in reps)
        print(f"  {name}: {', '.join(spans)}; prompt {long}; cached {cached}; retries {retries}")
        if "agent" in reps[0]["tokens"]:
            turns = " | ".join(" ".join(map(str, r["tokens"]["agent"])) for r in reps)
            print(f"  {name}: agent answer tokens per turn, each round: {turns}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="omlx,mlx-lm", help="comma list, omlx first")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 round of short rows (< 2 min)")
    parser.add_argument("--tokens", type=int, help="max_tokens of the decode rows (128)")
    parser.add_argument("--rows", default=",".join(ROW_GROUPS), help="comma list of rows")
    parser.add_argument("--peer-venvs", type=Path, default=WORK / "venvs")
    parser.add_argument("--install-peers", action="store_true", help="pip-install PyPI peers")
    parser.add_argument(
        "--blas",
        choices=list(BLAS_MODES),
        default="same-fast",
        help="same-fast: every server with the small-batch matmul setup.sh builds; shipped: "
        "only omlx (peers on OpenBLAS alone); same-openblas: none",
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    args.servers = args.servers.split(",")
    if args.quick:
        args.rounds = 1
    return args


def main() -> None:
    args = parse_args()
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    models = ensure_model(WORK / "base")
    failures: dict[str, str] = {}
    for name in [n for n in args.servers if n in PYPI_PEERS]:
        venv = args.peer_venvs / name
        try:
            if args.install_peers:
                ps.install_peer(PYPI_PEERS[name], venv, WORK / "logs" / f"{name}-install.log")
            elif not (venv / "bin" / name).exists():
                raise ps.ServerFailed(f"no venv at {venv}: run with --install-peers")
            else:
                ps.link_blas(venv)
        except ps.ServerFailed as exc:
            failures[name] = str(exc)
    args.servers = [n for n in args.servers if n not in failures]
    cfg = Config.quick() if args.quick else Config()
    cfg.tokens = args.tokens or cfg.tokens
    cfg.groups = parse_groups(args.rows)
    results, run_failures = run_rounds(args, models, cfg)
    failures.update(run_failures)
    print(f"\n{MODEL} float32, {cfg.tokens} tokens per decode request, median of {args.rounds}")
    print(f"agent session: {cfg.agent_turns} turns, answers <= {cfg.agent_tokens} tokens")
    fast = sorted(BLAS_MODES[args.blas] & set(args.servers)) or ["none"]
    print(f"BLAS: --blas {args.blas} (small-batch matmul for: {', '.join(fast)})")
    print_table(results)
    print_tokens(results)
    for name, why in failures.items():
        print(f"\n{name} FAILED: {why[:1500]}")
    save(args.json_out, results, failures)


if __name__ == "__main__":
    main()
