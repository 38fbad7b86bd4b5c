"""``omlx cluster hostfile | check | command``: set up a model split across Macs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from omlx.distributed.hosts import (
    compare,
    hostfile_json,
    parse_host,
    read_hostfile,
    remote_facts,
)
from omlx.settings import Settings


def add_cluster_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser(
        "cluster",
        help="write and check the hostfile of a model split across Macs (mlx.launch)",
    )
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    write = csub.add_parser("hostfile", help="write mlx.launch's JSON hostfile")
    write.add_argument(
        "--host",
        action="append",
        dest="hosts",
        required=True,
        metavar="NAME[=IP]",
        help="a host in rank order (rank 0 serves HTTP); IP: the link the ranks use",
    )
    write.add_argument("--backend", default="ring", choices=["ring", "jaccl"])
    write.add_argument("-o", "--output", type=Path, default=Path("hosts.json"))
    for name, text in (
        ("check", "check every host: reachable, same omlx/MLX/mlx-lm, has the model"),
        ("command", "print the mlx.launch command that starts the cluster"),
    ):
        p = csub.add_parser(name, help=text)
        p.add_argument("--hostfile", type=Path, default=Path("hosts.json"))
        p.add_argument("--model", required=True, help="the model's name in the model dirs")
        p.add_argument("--python", default=sys.executable, help="python on every host")
        p.add_argument(
            "--model-dir",
            action="append",
            dest="model_dirs",
            metavar="DIR",
            help="model folder on every host (repeatable; default: this host's setting)",
        )
    csub.choices["command"].add_argument(
        "--mode", choices=["auto", "tensor", "pipeline"], default="auto"
    )


def cluster_command(args: argparse.Namespace, settings: Settings) -> int:
    if args.cluster_command == "hostfile":
        hosts = [parse_host(h) for h in args.hosts]
        args.output.write_text(json.dumps(hostfile_json(hosts, args.backend), indent=2) + "\n")
        print(f"wrote {args.output} ({len(hosts)} hosts; rank 0 is {hosts[0].ssh})")
        return 0
    if args.cluster_command == "check":
        return _check(args, settings)
    print(launch_command(args.hostfile, args.python, args.model, args.mode, settings))
    return 0


def _check(args: argparse.Namespace, settings: Settings) -> int:
    hosts = read_hostfile(args.hostfile)
    dirs = [str(d) for d in settings.model_dirs]
    facts = [remote_facts(h, args.python, args.model, dirs) for h in hosts]
    reference = facts[0]
    failed = 0
    for rank, (host, found) in enumerate(zip(hosts, facts, strict=True)):
        problems = compare(reference, found, args.model)
        if rank == 0 and "error" not in found and found.get("model") is None:
            problems = [f"no model '{args.model}' in its model dirs"]
        failed += bool(problems)
        state = "ok" if not problems else "; ".join(problems)
        versions = "" if "error" in found else f" (omlx {found['omlx']}, MLX {found['mlx']})"
        print(f"rank {rank} {host}{versions}: {state}")
    if failed:
        print(f"{failed} of {len(hosts)} hosts cannot serve '{args.model}'", file=sys.stderr)
        return 1
    print(f"all {len(hosts)} hosts can serve '{args.model}'")
    return 0


def launch_command(hostfile: Path, python: str, model: str, mode: str, settings: Settings) -> str:
    """The command that starts every rank (run it on any machine with ssh to all)."""
    cmd = ["mlx.launch", "--hostfile", str(hostfile), "--python", python, "--"]
    cmd += ["-m", "omlx.cli", "serve", "--distributed", model, "--distributed-mode", mode]
    for d in settings.model_dirs:
        cmd += ["--model-dir", str(d)]
    cmd += ["--host", settings.server.host, "--port", str(settings.server.port)]
    return " ".join(shlex.quote(c) for c in cmd)
