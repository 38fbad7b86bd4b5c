"""The control plane between rank 0 and the other ranks: one TCP connection per
follower, length-prefixed frames. Rank 0 sends pickled calls; followers answer each
with a JSON reply (never pickle: rank 0 unpickles nothing it receives).

The forwards' own traffic (tensor-parallel sums, pipeline sends) goes over MLX's
backend; this socket only carries what to run, so a dead rank shows up here as a
closed connection or a reply that does not come in time, named by its rank."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import pickle
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from omlx.errors import ServiceUnavailableError
from omlx.memory import mlx_stats

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
# A reply comes when the follower finished the same step as rank 0 (the forwards run
# in lockstep through their collectives); this bounds a follower that stopped answering.
REPLY_TIMEOUT_S = 120.0
ACCEPT_TIMEOUT_S = 120.0
TOKEN_BYTES = 16


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes:
    """One frame; ConnectionError when the peer closed the connection."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


@dataclass
class FollowerLink:
    rank: int
    sock: socket.socket
    # The follower's last reply's memory fields (bytes) and its own hard limit.
    memory: dict[str, int] = field(default_factory=dict)
    cache: dict[str, Any] | None = None  # its prefix cache's counters (None: it keeps none)
    replied_at: float = 0.0


class Leader:
    """Rank 0's side: the links to every follower, calls out, replies back."""

    def __init__(self, links: list[FollowerLink], world_size: int):
        self.links = links
        self.world_size = world_size
        self.lost: dict[int, str] = {}  # rank -> why
        self._lock = threading.Lock()

    @classmethod
    def accept(cls, server: socket.socket, token: bytes, world_size: int) -> Leader:
        """Wait for every follower to connect and prove it got the token."""
        server.settimeout(ACCEPT_TIMEOUT_S)
        links: dict[int, FollowerLink] = {}
        while len(links) < world_size - 1:
            conn, _ = server.accept()
            conn.settimeout(ACCEPT_TIMEOUT_S)
            hello = json.loads(recv_frame(conn))
            if not hmac.compare_digest(bytes.fromhex(hello.get("token", "")), token):
                conn.close()  # not one of ours
                continue
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            links[int(hello["rank"])] = FollowerLink(int(hello["rank"]), conn)
        server.close()
        return cls([links[r] for r in sorted(links)], world_size)

    def call(self, message: Any) -> list[dict[str, Any]]:
        """Send ``message`` to every follower (before running it here: the forwards
        meet in their collectives). Returns nothing; ``collect`` reads the replies."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.raise_if_lost()
            for link in self.links:
                try:
                    send_frame(link.sock, payload)
                except OSError as exc:
                    self._lose(link, f"the control connection failed ({exc})")
            self.raise_if_lost()
        return []

    def collect(self) -> list[Any]:
        """Every follower's reply to the last call (its result, when it returned one)."""
        results = []
        with self._lock:
            for link in self.links:
                reply = self._reply(link)
                if reply is None:
                    continue
                if not reply.get("ok"):
                    self._lose(link, f"it failed: {reply.get('error')}")
                    continue
                link.memory, link.replied_at = reply.get("memory", {}), time.monotonic()
                link.cache = reply.get("cache")
                results.append(reply.get("result"))
            self.raise_if_lost()
        return results

    def _reply(self, link: FollowerLink) -> dict[str, Any] | None:
        try:
            reply: dict[str, Any] = json.loads(recv_frame(link.sock))
            return reply
        except TimeoutError:
            self._lose(link, f"it did not answer within {REPLY_TIMEOUT_S:.0f} s")
        except (OSError, ConnectionError) as exc:
            self._lose(link, f"its control connection closed ({exc})")
        return None

    def _lose(self, link: FollowerLink, why: str) -> None:
        if link.rank not in self.lost:
            self.lost[link.rank] = why
            log.error("distributed: rank %d of %d is gone: %s", link.rank, self.world_size, why)
            # A step's collective with that rank (a decode's next token, computed
            # ahead) may never finish on this one: nothing may wait for it.
            mlx_stats.streams_stuck(f"distributed rank {link.rank} is gone")
        with contextlib.suppress(OSError):
            link.sock.close()

    def raise_if_lost(self) -> None:
        if self.lost:
            rank, why = next(iter(sorted(self.lost.items())))
            raise ServiceUnavailableError(
                f"distributed rank {rank} of {self.world_size} stopped ({why}); the model is "
                "split across the ranks, so nothing can run until the cluster is restarted "
                "with `mlx.launch`",
                retry_after_s=30,
            )

    def check_alive(self) -> None:
        """Between calls (idle): a follower whose connection closed is lost now,
        not at the next request. Non-blocking; never steals a reply (none is pending
        while the lock is free)."""
        if not self._lock.acquire(blocking=False):
            return  # a call is running: it notices by itself
        try:
            for link in self.links:
                if link.rank in self.lost:
                    continue
                try:
                    # select first: a socket with a timeout waits that long in recv.
                    readable, _, _ = select.select([link.sock], [], [], 0)
                    if not readable:
                        continue
                    data = link.sock.recv(1, socket.MSG_PEEK)
                except OSError as exc:
                    self._lose(link, f"its control connection failed ({exc})")
                    continue
                if not data:
                    self._lose(link, "its control connection closed (the process ended)")
        finally:
            self._lock.release()

    def close(self) -> None:
        for link in self.links:
            with contextlib.suppress(OSError):
                link.sock.close()


def connect_to_leader(host: str, port: int, token: bytes, rank: int) -> socket.socket:
    """A follower's connection to rank 0, retried while rank 0 starts listening."""
    deadline = time.monotonic() + ACCEPT_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_frame(sock, json.dumps({"token": token.hex(), "rank": rank}).encode())
    sock.settimeout(None)  # idle followers wait for rank 0 as long as it lives
    return sock
