"""Where each request of a step runs, decided from what the runner holds. Pure: no MLX.

A lone text request prefills unbatched (``SOLO``) when the execution strategy allows
it and nothing else runs. Otherwise a text request is a row of the batch (``BATCH``),
or prefills on the side when the model's caches need a snapshot at each block
boundary (``SIDE``: recurrent, sliding window); a prompt with images always prefills
on the side (``IMAGE_SIDE``), as every prompt of a model that embeds them all does.
The choices of one prompt started together (``n``) wait for the first of them, their
leader, and fork from its cache (``FORK``) when the prompt is longer than a shared
opening covers. Side sequences join the batch at their last prompt token.

The solo sequence moves when others arrive (to the side while it still prefills a
snapshotted cache, else into the batch), and on its own once its first token is out,
when the batch decodes it faster: the batch's compiled step is proven (a batch of one
decodes faster than the lone sequence's own step on the CPU backend, measured by an
interleaved A/B: benchmarks/README.md, "Figures behind design choices"), or the request
drafts (only the batch speculates); and its cache is plain KV. The move copies the
cache once, as a second request's arrival always did; admission already holds a
whole-context copy for a prompt's last prefill chunk, and the move comes right after it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from omlx.scheduler.request import Request


class Placement(enum.Enum):
    SOLO = "solo"
    BATCH = "batch"
    SIDE = "side"
    IMAGE_SIDE = "image side"
    FORK = "fork"


@dataclass(frozen=True, slots=True)
class SoloState:
    """The runner's lone sequence, as the planner needs it."""

    request_id: str
    # Prompt tokens not in its cache yet.
    num_pending: int
    # Its first token is out and its cache is plain KV layers: the batch can take it.
    movable: bool
    # It would draft in the batch (speculation is on and its request drafts).
    would_draft: bool


@dataclass(frozen=True, slots=True)
class RunnerLayout:
    """What the runner holds and may do (``BatchRunner.layout``); the default is an
    empty runner that batches everything."""

    # Where each running request is (the solo one, side, image side, batch rows, forks).
    placed: Mapping[str, Placement] = field(default_factory=dict)
    # A forked choice still waiting -> its leader.
    leaders: Mapping[str, str] = field(default_factory=dict)
    solo: SoloState | None = None
    # The strategy lets a lone request prefill unbatched.
    solo_prefill: bool = False
    # The model's caches need block-boundary snapshots: joining requests prefill aside.
    snapshots: bool = False
    # The model embeds every prompt as mlx-vlm does, text ones too (gemma3n's text rows
    # unscaled there, scaled by id; paligemma's text prompt in one forward): each
    # prefills on the image side.
    embedded_prompts: bool = False
    # The batch's compiled decode step is proven (it decodes a lone request faster).
    batch_compiled: bool = False
    # The model's caches cannot join the batch (batch.merges): every request prefills
    # aside and decodes as the solo sequence (its model serves one at a time).
    apart: bool = False
    # Choices of one prompt fork from their leader from this length on (shorter ones:
    # the shared opening covers them); 0: never.
    min_fork_prompt: int = 0

    @property
    def batched(self) -> bool:
        """Something runs besides a solo sequence: a new request cannot run solo."""
        return any(p is not Placement.SOLO for p in self.placed.values())

    def without(self, request_ids: Collection[str]) -> RunnerLayout:
        """The layout once ``request_ids`` left (a choice whose leader left starts
        as a batch row of its own)."""
        if not request_ids:
            return self
        gone = set(request_ids)
        placed = {rid: p for rid, p in self.placed.items() if rid not in gone}
        leaders = {f: lead for f, lead in self.leaders.items() if f not in gone}
        for follower in [f for f, lead in leaders.items() if lead in gone]:
            placed[follower] = Placement.BATCH
            del leaders[follower]
        solo = None if self.solo is not None and self.solo.request_id in gone else self.solo
        return dataclasses.replace(self, placed=placed, leaders=leaders, solo=solo)


@dataclass(frozen=True, slots=True)
class Placements:
    """The step's placements: every running or starting request's, after the moves
    (the runner acts on the starting ones' and the solo move; a side sequence joins the
    batch at its last prompt token, a fork once its leader's prompt is in)."""

    where: Mapping[str, Placement] = field(default_factory=dict)
    # A forked choice -> the request whose prompt it waits for.
    leaders: Mapping[str, str] = field(default_factory=dict)
    # Where the solo sequence goes this step (None: it stays solo, or there is none).
    solo_move: Placement | None = None


def place(admitted: Sequence[Request], layout: RunnerLayout) -> Placements:
    """Where the requests starting now run, and whether the solo sequence moves."""
    embedded = [bool(r.images) or layout.embedded_prompts for r in admitted]
    with_images = [r for r, e in zip(admitted, embedded, strict=True) if e]
    text = [r for r, e in zip(admitted, embedded, strict=True) if not e]
    solo = bool(
        layout.solo_prefill
        and len(text) == 1
        and not with_images
        and layout.solo is None
        and not layout.batched
    )
    solo_move = _solo_move(layout, with_images, text)
    where = dict(layout.placed)
    leaders = dict(layout.leaders)
    if layout.solo is not None and solo_move is not None:
        where[layout.solo.request_id] = solo_move
    where.update({r.request_id: Placement.IMAGE_SIDE for r in with_images})
    if solo:
        where[text[0].request_id] = Placement.SOLO
    elif layout.snapshots or layout.apart:
        where.update({r.request_id: Placement.SIDE for r in text})
    else:
        forks = _fork_leaders(text, layout.min_fork_prompt)
        where.update({r.request_id: _batch_or_fork(r, forks) for r in text})
        leaders.update(forks)
    return Placements(where, leaders, solo_move)


def _solo_move(
    layout: RunnerLayout, with_images: Sequence[Request], text: Sequence[Request]
) -> Placement | None:
    """Where the solo sequence goes: an image prompt's arrival sends it to the batch;
    a text prompt's, to the side while it still prefills a snapshotted cache, else
    to the batch; alone, to the batch once that decodes it faster; never where the
    caches cannot join the batch (``apart``)."""
    solo = layout.solo
    if solo is None or layout.apart:
        return None
    if with_images:
        return Placement.BATCH
    if text:
        still_prefilling = layout.snapshots and solo.num_pending > 1
        return Placement.SIDE if still_prefilling else Placement.BATCH
    if solo.movable and (layout.batch_compiled or solo.would_draft):
        return Placement.BATCH
    return None


def _fork_leaders(text: Sequence[Request], min_prompt: int) -> dict[str, str]:
    """Each request repeating an earlier one's long prompt -> that earlier one."""
    firsts: dict[tuple[int, ...], str] = {}
    leaders: dict[str, str] = {}
    for r in text:
        leader = firsts.get(r.prompt_ids)
        if leader is not None:
            leaders[r.request_id] = leader
        elif min_prompt and len(r.prompt_ids) >= min_prompt:
            firsts[r.prompt_ids] = r.request_id
    return leaders


def _batch_or_fork(request: Request, leaders: Mapping[str, str]) -> Placement:
    return Placement.FORK if request.request_id in leaders else Placement.BATCH
