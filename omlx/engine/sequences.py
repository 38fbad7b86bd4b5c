"""The requests the runner runs as sequences of their own, one record each. MLX thread only.

Batch rows live in ``batch.PrefillBatch`` / ``batch.DecodeBatch`` and waiting forks in
``forks.ChoiceForks``; every other running request is a ``Running`` record here: where
the plan placed it (scheduler/placement.py), its ``solo.SoloSequence`` and its request.

- SOLO (at most one): prefills and decodes in its own sequence until the plan moves it
  (to the side or into the batch).
- SIDE, IMAGE_SIDE: prefills there (block-boundary snapshots; images encoded first),
  then joins the batch at its last prompt token (or, where its cache cannot batch and no
  solo sequence runs, goes on as the solo one).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from omlx.engine.solo import SoloSequence
from omlx.mlx_types import CacheLayer
from omlx.scheduler import Request
from omlx.scheduler.placement import Placement

_OWN = (Placement.SOLO, Placement.SIDE, Placement.IMAGE_SIDE)


@dataclass(slots=True)
class Running:
    """One request running as its own sequence."""

    placement: Placement
    sequence: SoloSequence
    request: Request

    @property
    def request_id(self) -> str:
        return self.request.request_id


class Sequences:
    """The runner's own sequences by request id, in the order they started (the order
    they step and the memory gate sees their chunks): the solo one, then the side ones."""

    def __init__(self) -> None:
        self._running: dict[str, Running] = {}

    def __bool__(self) -> bool:
        return bool(self._running)

    def __iter__(self) -> Iterator[Running]:
        return iter(list(self._running.values()))

    @property
    def solo(self) -> Running | None:
        """The lone sequence (None: none, or it moved)."""
        return next((r for r in self._running.values() if r.placement is Placement.SOLO), None)

    def start(self, placement: Placement, sequence: SoloSequence, request: Request) -> None:
        assert placement in _OWN, f"{placement} runs in the batch"
        if placement is Placement.SOLO:
            assert self.solo is None, "two solo sequences planned"
        self._running[request.request_id] = Running(placement, sequence, request)

    def to_side(self, running: Running) -> None:
        """The solo sequence prefills on the side from now on (after those there)."""
        del self._running[running.request_id]
        self._running[running.request_id] = Running(
            Placement.SIDE, running.sequence, running.request
        )

    def to_solo(self, running: Running) -> None:
        """A side sequence past its prompt decodes on its own (its cache cannot batch)."""
        assert self.solo is None, "two solo sequences"
        running.placement = Placement.SOLO

    def pop(self, request_id: str) -> Running:
        return self._running.pop(request_id)

    def placed(self) -> dict[str, Placement]:
        return {rid: r.placement for rid, r in self._running.items()}

    def sides(self) -> list[Running]:
        return [r for r in self._running.values() if r.placement is not Placement.SOLO]

    def prefilling(self) -> list[SoloSequence]:
        """Every sequence that may prefill a chunk next step: the solo one first."""
        solo = self.solo
        first = [solo.sequence] if solo is not None else []
        return first + [r.sequence for r in self.sides()]

    def remove(self, request_ids: set[str]) -> dict[str, tuple[list[CacheLayer], int]]:
        """Take the leaving ones out: each one's cache and the tokens it holds."""
        gone = [self._running.pop(rid) for rid in request_ids & self._running.keys()]
        return {r.request_id: (r.sequence.cache, r.sequence.num_cached) for r in gone}

    def clear(self) -> None:
        self._running.clear()
