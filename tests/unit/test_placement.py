"""Where each request runs (solo, batch row, side, image side, fork) and when the solo
sequence moves: the plan's decision (scheduler/placement.py), pure, as
``Scheduler.schedule`` hands it to the runner. The runner executing it against the real
model is tests/integration/test_runner_steps.py and test_execution_strategy.py."""

from __future__ import annotations

from omlx.scheduler import Request, SamplingParams, Scheduler
from omlx.scheduler.placement import Placement, RunnerLayout, SoloState, place
from omlx.scheduler.plan import PrefillChunk
from tests.fixtures.budget_view import BudgetView

SOLO, BATCH, SIDE, IMAGE_SIDE, FORK = (
    Placement.SOLO,
    Placement.BATCH,
    Placement.SIDE,
    Placement.IMAGE_SIDE,
    Placement.FORK,
)


def _request(rid: str, n: int = 20, *, first: int = 3, images: object = None) -> Request:
    prompt = tuple(range(first, first + n))
    return Request(rid, prompt, SamplingParams(max_tokens=8), images=images)


def _solo(rid: str = "s", *, pending: int = 0, movable: bool = True, drafts: bool = False):
    return SoloState(rid, pending, movable=movable, would_draft=drafts)


def test_a_lone_request_runs_solo_only_when_the_strategy_allows_and_nothing_runs() -> None:
    lone = [_request("a")]
    assert place(lone, RunnerLayout(solo_prefill=True)).where == {"a": SOLO}
    assert place(lone, RunnerLayout(solo_prefill=False)).where == {"a": BATCH}
    busy = RunnerLayout({"b": BATCH}, solo_prefill=True)
    assert place(lone, busy).where == {"a": BATCH, "b": BATCH}
    two = place([_request("a"), _request("b", first=50)], RunnerLayout(solo_prefill=True))
    assert two.where == {"a": BATCH, "b": BATCH} and two.solo_move is None


def test_snapshotted_caches_prefill_joining_requests_on_the_side() -> None:
    layout = RunnerLayout(solo_prefill=True, snapshots=True)
    placed = place([_request("a"), _request("b", first=50)], layout)
    assert placed.where == {"a": SIDE, "b": SIDE}


def test_a_prompt_with_images_prefills_on_the_side_and_sends_the_solo_to_the_batch() -> None:
    still_prefilling = _solo(pending=40, movable=False)
    layout = RunnerLayout({"s": SOLO}, solo=still_prefilling, solo_prefill=True, snapshots=True)
    placed = place([_request("v", images=object())], layout)
    assert placed.where == {"s": BATCH, "v": IMAGE_SIDE} and placed.solo_move is BATCH


def test_a_text_arrival_sends_a_prefilling_snapshotted_solo_to_the_side_else_the_batch() -> None:
    prefilling = _solo(pending=40, movable=False)
    for snapshots, move in ((True, SIDE), (False, BATCH)):
        layout = RunnerLayout({"s": SOLO}, solo=prefilling, solo_prefill=True, snapshots=snapshots)
        placed = place([_request("a")], layout)
        assert placed.solo_move is move and placed.where["s"] is move
        assert placed.where["a"] is (SIDE if snapshots else BATCH)
    # Down to its last prompt token it goes to the batch even with snapshots.
    last = RunnerLayout({"s": SOLO}, solo=_solo(pending=1, movable=False), snapshots=True)
    assert place([_request("a")], last).solo_move is BATCH


def test_alone_the_solo_moves_once_the_batch_decodes_it_faster() -> None:
    def move(solo: SoloState, compiled: bool) -> Placement | None:
        layout = RunnerLayout({solo.request_id: SOLO}, solo=solo, batch_compiled=compiled)
        return place((), layout).solo_move

    assert move(_solo(), compiled=True) is BATCH
    assert move(_solo(drafts=True), compiled=False) is BATCH  # only the batch speculates
    assert move(_solo(), compiled=False) is None
    # Not before its first token is out, nor with a cache that is not plain KV.
    assert move(_solo(pending=30, movable=False), compiled=True) is None


def test_the_choices_of_one_long_prompt_fork_from_the_first() -> None:
    layout = RunnerLayout(min_fork_prompt=67)
    long = [_request(f"c{i}", 80) for i in range(3)] + [_request("other", 80, first=200)]
    placed = place(long, layout)
    assert placed.where == {"c0": BATCH, "c1": FORK, "c2": FORK, "other": BATCH}
    assert placed.leaders == {"c1": "c0", "c2": "c0"}
    # Shorter prompts: the shared opening covers them; each is a row of its own.
    short = place([_request(f"c{i}", 40) for i in range(3)], layout)
    assert set(short.where.values()) == {BATCH} and short.leaders == {}


def test_a_choice_whose_leader_leaves_becomes_a_row_of_its_own() -> None:
    layout = RunnerLayout({"c0": BATCH, "c1": FORK}, leaders={"c1": "c0"}, min_fork_prompt=67)
    assert layout.without(["c0"]).placed == {"c1": BATCH}
    assert layout.without(["c1"]).placed == {"c0": BATCH}


def test_the_plan_places_the_started_requests_on_the_runner_without_the_leaving_ones() -> None:
    """A solo sequence preempted for KV capacity is out before anything is placed; a
    request the gate sent back unstarted is placed nowhere."""
    scheduler = Scheduler(max_running=4, max_waiting=8, prefill_step_size=64)
    scheduler.add(_request("a", 40))
    first = scheduler.schedule(BudgetView(budget=10**6), layout=RunnerLayout(solo_prefill=True))
    assert first.placements.where == {"a": SOLO}
    scheduler.add(_request("b", 40, first=100))
    layout = RunnerLayout({"a": SOLO}, solo=_solo("a"), solo_prefill=True, batch_compiled=True)
    plan = scheduler.schedule(BudgetView(budget=10**6), layout=layout)
    assert plan.placements.where == {"a": BATCH, "b": BATCH}
    assert plan.placements.solo_move is BATCH


def test_the_plan_names_each_chunk_as_the_gate_passed_it_and_the_drafts() -> None:
    scheduler = Scheduler(max_running=4, max_waiting=8, prefill_step_size=64)
    for rid in ("a", "b"):
        scheduler.add(_request(rid, 200, first=3 if rid == "a" else 300))
    scheduler.schedule(BudgetView(budget=10**6))
    chunks = [PrefillChunk("a", 64, 128, 136), PrefillChunk("b", 64, 128, 136)]
    drafts = [PrefillChunk("a", 4, 140, 4)]
    capped = scheduler.schedule(BudgetView(budget=64), chunks, drafts)
    assert capped.prefill_cap == 32
    assert [(c.request_id, c.num_tokens) for c in capped.chunks] == [("a", 32), ("b", 32)]
    assert capped.drafts == (drafts[0],) and capped.speculate
    refused = scheduler.schedule(BudgetView(budget=2), (), drafts)
    assert not refused.speculate and refused.drafts == ()


def test_a_model_that_embeds_every_prompt_prefills_text_ones_on_the_image_side() -> None:
    # gemma3n: mlx-vlm's generate embeds a text-only prompt otherwise than the language
    # model embeds ids, so every prompt goes the image path (RunnerLayout.embedded_prompts).
    lone = [_request("a")]
    layout = RunnerLayout(solo_prefill=True, snapshots=True, embedded_prompts=True)
    assert place(lone, layout).where == {"a": IMAGE_SIDE}
    two = place([_request("a"), _request("v", images=object())], layout)
    assert two.where == {"a": IMAGE_SIDE, "v": IMAGE_SIDE}
    assert place(lone, RunnerLayout(solo_prefill=True, snapshots=True)).where == {"a": SOLO}
