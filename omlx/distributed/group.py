"""Joining the distributed group that ``mlx.launch`` started, and opening the control
connections: rank 0 listens on its own ring address, the other ranks connect to it
with a token rank 0 handed out through one MLX collective."""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from omlx.distributed.control import TOKEN_BYTES, Leader, connect_to_leader
from omlx.errors import SettingsError
from omlx.settings import mlx_launch_env

LAUNCH_HINT = (
    "start it under mlx.launch, e.g. `mlx.launch --hostfile hosts.json -- omlx serve "
    "--distributed MODEL` (`omlx cluster command` prints the full command)"
)


@dataclass(frozen=True, slots=True)
class Membership:
    group: Any  # mx.distributed.Group
    rank: int
    size: int
    backend: str


def join(backend: str) -> Membership:
    """This process's place in the group; SettingsError when not started by mlx.launch."""
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except (RuntimeError, ValueError) as exc:
        raise SettingsError(f"--distributed: no distributed group ({exc}); {LAUNCH_HINT}") from exc
    if group.size() < 2:
        raise SettingsError(f"--distributed needs at least 2 ranks, found 1; {LAUNCH_HINT}")
    return Membership(group, group.rank(), group.size(), backend)


def leader_address() -> str:
    """Where the followers reach rank 0: its address in the launcher's hostfile (ring:
    ``MLX_HOSTFILE``; JACCL: ``MLX_JACCL_COORDINATOR``), else loopback."""
    hostfile, coordinator = mlx_launch_env()
    if hostfile and os.path.isfile(hostfile):
        with open(hostfile, encoding="utf-8") as fh:
            ranks = json.load(fh)
        if ranks and ranks[0]:
            return str(ranks[0][0]).rsplit(":", 1)[0]
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    return "127.0.0.1"


def open_control(member: Membership) -> tuple[Leader | None, socket.socket | None]:
    """Rank 0: the Leader over every follower's connection. Others: their socket."""
    import mlx.core as mx

    host = leader_address()
    server = None
    # Rank 0's port and token, summed into every rank (the others add zeros).
    shared = [0] * (2 + TOKEN_BYTES)
    if member.rank == 0:
        server = socket.create_server((host, 0))
        port, token = server.getsockname()[1], secrets.token_bytes(TOKEN_BYTES)
        shared = [port >> 8, port & 0xFF, *token]
    summed = mx.distributed.all_sum(
        mx.array(shared, dtype=mx.int32), group=member.group, stream=mx.cpu
    )
    values = [int(v) for v in summed.tolist()]
    port, token = (values[0] << 8) | values[1], bytes(values[2:])
    if server is not None:
        return Leader.accept(server, token, member.size), None
    return None, connect_to_leader(host, port, token, member.rank)
