"""Rank 0's view of the distributed group: it loads the one model on every rank,
wraps the engine's runner and memory probe, refuses what cannot run split, and
reports each rank (``/health``, the admin panel)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

from omlx.distributed.control import Leader
from omlx.distributed.group import Membership
from omlx.distributed.loading import load_shard
from omlx.distributed.replica import ReplicatingRunner
from omlx.engine.model_engine import ModelEngine
from omlx.engine.stream import RequestStream
from omlx.errors import InvalidRequestError, ModelLoadError, OmlxError
from omlx.memory.budget import KVProfile, Limits, MemoryReading
from omlx.memory.dims import ModelDims, rank_share
from omlx.memory.guard import MemoryGuard
from omlx.memory.probe import MemoryProbe
from omlx.models.discovery import ModelInfo
from omlx.models.loader import LoadedModel
from omlx.scheduler import Request

log = logging.getLogger(__name__)

_READING_FIELDS = (
    "mlx_active_bytes",
    "process_footprint_bytes",
    "recent_peak_bytes",
    "mlx_cache_bytes",
)


class Cluster:
    """``model``: the one model this group serves; ``mode``: auto, tensor or pipeline."""

    def __init__(self, member: Membership, leader: Leader, model: str, mode: str):
        self.member = member
        self.leader = leader
        self.model = model
        self.mode = mode
        self.parallel: str | None = None  # what the load chose: "tensor" or "pipeline"
        # The KV one token takes on the busiest rank (its share of heads or layers).
        self.rank_kv_bytes_per_token: int | None = None
        self.started_at = time.time()

    def load(self, info: ModelInfo) -> LoadedModel:
        """MLX thread: every rank loads its shard of ``info`` (the served model only)."""
        if info.name != self.model:
            raise ModelLoadError(
                f"this server runs '{self.model}' split across {self.member.size} ranks and "
                f"serves no other model; '{info.name}' needs a server of its own"
            )
        self.leader.call(("load", info.name, (), {}))
        try:
            loaded = load_shard(info, self.member, self.mode)
        except Exception:
            # Rank 0's reason (e.g. the model cannot be split) is the one to show.
            with contextlib.suppress(OmlxError):
                self.leader.collect()
            raise
        self.leader.collect()
        self.parallel = loaded.config.get("omlx_parallel")
        return loaded

    def rank_dims(self, dims: ModelDims) -> ModelDims:
        """The busiest rank's share of the model (after ``load``): the guard's dims."""
        shared = rank_share(dims, self.parallel, self.member.size)
        self.rank_kv_bytes_per_token = shared.kv_bytes_per_token
        return shared

    @property
    def engine_class(self) -> type[ModelEngine]:
        return DistributedEngine

    def runner(self, runner: Any) -> ReplicatingRunner:
        return ReplicatingRunner(runner, self.leader)

    def probe(self, local: MemoryProbe, limits: Limits) -> ClusterProbe:
        return ClusterProbe(local, self.leader, limits.hard_bytes)

    @staticmethod
    def skip_profile(guard: MemoryGuard, explicit_kv_tokens: int | None) -> str:
        """No auto-profile (its forwards would run on rank 0 alone): an explicit KV
        capacity still applies; otherwise the guard works from live readings."""
        if explicit_kv_tokens is None:
            return "skipped (distributed)"
        guard.set_profile(
            KVProfile(max_kv_tokens=explicit_kv_tokens, source="explicit", baseline_bytes=0)
        )
        return "explicit"

    def status(self, local: MemoryReading, hard_bytes: int) -> dict[str, Any]:
        """Each rank: alive or lost (why), its memory and its own limit."""
        self.leader.check_alive()
        ranks = [
            {
                "rank": 0,
                "state": "serving",
                "memory": {**_reading_dict(local), "limit_bytes": hard_bytes},
            }
        ]
        for link in self.leader.links:
            lost = self.leader.lost.get(link.rank)
            ranks.append(
                {
                    "rank": link.rank,
                    "state": "lost" if lost else "following",
                    "error": lost,
                    "memory": dict(link.memory) or None,
                }
            )
        return {
            "model": self.model,
            "parallel": self.parallel or self.mode,
            "backend": self.member.backend,
            "world_size": self.member.size,
            "kv_bytes_per_token_per_rank": self.rank_kv_bytes_per_token,
            "healthy": not self.leader.lost,
            "ranks": ranks,
        }


class ClusterProbe:
    """The engine's memory probe when distributed: each reading is the worst rank's,
    each follower's scaled by its own limit against rank 0's, so a step any rank
    cannot afford is not admitted or run (rank 0's guard decides for all)."""

    def __init__(self, local: MemoryProbe, leader: Leader, hard_bytes: int):
        self._local = local
        self._leader = leader
        self._hard_bytes = hard_bytes

    def reading(self, *, fresh: bool = False) -> MemoryReading:
        own = self._local.reading(fresh=fresh)
        worst = {f: getattr(own, f) for f in _READING_FIELDS}
        for link in self._leader.links:
            theirs = link.memory
            limit = theirs.get("limit_bytes") or 0
            if not limit:
                continue
            scale = self._hard_bytes / limit
            for f in _READING_FIELDS:
                worst[f] = max(worst[f], int(theirs.get(f, 0) * scale))
        return dataclasses.replace(own, **worst)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)


def follower_memory(probe: MemoryProbe, hard_bytes: int) -> dict[str, int]:
    """What a follower reports with every reply."""
    return {**_reading_dict(probe.reading(fresh=True)), "limit_bytes": hard_bytes}


def _reading_dict(reading: MemoryReading) -> dict[str, int]:
    out = {f: int(getattr(reading, f)) for f in _READING_FIELDS}
    out["resident_bytes"] = reading.resident_bytes
    return out


class DistributedEngine(ModelEngine):
    """A ModelEngine whose forwards run split across ranks: requests that need work
    the followers cannot replay are refused with a clear 400."""

    @property
    def num_draft(self) -> int:
        return 0

    @num_draft.setter
    def num_draft(self, value: int) -> None:
        # Drafting is not replayed on the followers yet: speculative decoding stays off.
        if value:
            log.warning(
                "speculative decoding is off for %s: the model is split across ranks "
                "(omlx serve --distributed); its `speculative` setting is ignored",
                self.name,
            )

    def submit_together(self, pairs: list[tuple[Request, RequestStream]]) -> None:
        self._runner.raise_if_lost()  # type: ignore[attr-defined]  # a ReplicatingRunner
        for request, _ in pairs:
            if request.grammar is not None:
                raise InvalidRequestError(
                    "structured output and strict tool calls (a grammar) are not available "
                    "when the model is split across ranks (omlx serve --distributed); send "
                    "the request without response_format json_schema / strict tools",
                    param="response_format",
                )
        super().submit_together(pairs)

    def run_on_mlx(self, fn: Any, *args: Any, even_if_closed: bool = False) -> Any:
        # Its only user is prompt scoring (echo / prompt logprobs), a forward of rank 0
        # alone that the other ranks would never join.
        if not even_if_closed:
            raise InvalidRequestError(
                "prompt logprobs (echo with logprobs) are not available when the model is "
                "split across ranks (omlx serve --distributed)",
                param="echo",
            )
        return super().run_on_mlx(fn, *args, even_if_closed=even_if_closed)
