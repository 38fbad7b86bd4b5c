"""``omlx cluster``'s work: the hostfile mlx.launch reads, each host's facts (omlx,
MLX and mlx-lm versions, the model's files) gathered over ssh, and the checks that
every host can serve its shard of the same model. No MLX import (versions come from
package metadata)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import omlx
from omlx.errors import SettingsError
from omlx.models.discovery import discover_models

SSH_TIMEOUT_S = 20
# mlx.launch runs a host named 127.0.0.1 without ssh (any other name over ssh); so do
# the checks.
LOCAL_HOSTS = ("127.0.0.1",)


@dataclass(frozen=True, slots=True)
class HostEntry:
    ssh: str  # the name ssh reaches it by
    ip: str  # the address the ring backend connects to


def parse_host(spec: str) -> HostEntry:
    """``NAME`` or ``NAME=IP`` (the IP of the link the ranks talk over, e.g. the
    Thunderbolt bridge); a bare NAME is resolved here."""
    name, _, ip = spec.partition("=")
    if not name:
        raise SettingsError(f"--host {spec!r}: give NAME or NAME=IP")
    if not ip:
        try:
            ip = socket.gethostbyname(name)
        except OSError as exc:
            raise SettingsError(
                f"--host {name}: cannot resolve it ({exc}); give its address as {name}=IP"
            ) from exc
    try:
        ipaddress.ip_address(ip)
    except ValueError as exc:
        raise SettingsError(f"--host {spec!r}: {ip!r} is not an IP address") from exc
    return HostEntry(name, ip)


def hostfile_json(hosts: list[HostEntry], backend: str = "ring") -> dict[str, Any]:
    """mlx.launch's JSON hostfile (mlx/_distributed_utils/common.py ``Hostfile``)."""
    if len(hosts) < 2:
        raise SettingsError("a cluster needs at least 2 hosts (repeat --host)")
    return {
        "backend": backend,
        "envs": [],
        "hosts": [{"ssh": h.ssh, "ips": [h.ip], "rdma": []} for h in hosts],
    }


def read_hostfile(path: Path) -> list[str]:
    """The ssh names of a hostfile's hosts, in rank order."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SettingsError(f"cannot read the hostfile {path}: {exc}") from exc
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list) or not all(isinstance(h, dict) and h.get("ssh") for h in hosts):
        raise SettingsError(f"{path}: expected {{'hosts': [{{'ssh': NAME, 'ips': [IP]}}, ...]}}")
    return [str(h["ssh"]) for h in hosts]


def local_facts(model: str, model_dirs: list[Path]) -> dict[str, Any]:
    """What this host would serve with: versions and the model's files."""
    facts: dict[str, Any] = {
        "omlx": str(getattr(omlx, "__version__", "unknown")),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "python": sys.executable,
    }
    info = discover_models(model_dirs).get(model)
    facts["model"] = None if info is None else _model_facts(info.path)
    return facts


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _model_facts(path: Path) -> dict[str, Any]:
    """Enough to tell two copies apart cheaply: the config's hash and the files' sizes."""
    files = sorted(p for p in path.iterdir() if p.is_file())
    config = path / "config.json"
    return {
        "path": str(path),
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
        "bytes": sum(p.stat().st_size for p in files),
        "files": len(files),
    }


def remote_facts(host: str, python: str, model: str, model_dirs: list[str]) -> dict[str, Any]:
    """``local_facts`` of ``host``, run with its ``python`` (over ssh unless local).
    Returns {"error": why} when the host cannot be asked."""
    cmd = [python, "-m", "omlx.distributed.hostfacts", "--model", model]
    for d in model_dirs:
        cmd += ["--model-dir", d]
    if host not in LOCAL_HOSTS:
        remote = " ".join(shlex.quote(c) for c in cmd)
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, remote]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=SSH_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"cannot run the check: {exc}"}
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"error": why[:300]}
    try:
        facts: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"error": f"unexpected answer: {done.stdout[:200]!r}"}
    return facts


def compare(reference: dict[str, Any], facts: dict[str, Any], model: str) -> list[str]:
    """Why a host (``facts``) cannot join a group led by ``reference`` (empty: it can)."""
    if "error" in facts:
        return [f"unreachable: {facts['error']}"]
    problems = [
        f"{key} {facts.get(key)} (first host: {reference.get(key)})"
        for key in ("omlx", "mlx", "mlx_lm")
        if facts.get(key) != reference.get(key)
    ]
    theirs, ours = facts.get("model"), reference.get("model")
    if theirs is None:
        problems.append(f"no model '{model}' in its model dirs")
    elif ours is not None and (
        theirs["config_sha256"] != ours["config_sha256"] or theirs["bytes"] != ours["bytes"]
    ):
        problems.append(f"its copy of '{model}' differs from the first host's")
    return problems
