"""The step contract (issue 28): ``Scheduler.schedule(memory, chunks)`` returns a
frozen plan: who starts (with their cached tokens), who is preempted, who is
ended, and the prefill cap. Pure: the memory view here is a budget of prefill
tokens per step and a KV capacity, answered by the real ``shape_prefill`` rules."""

from __future__ import annotations

import dataclasses

import pytest

from omlx.scheduler import Request, RequestStatus, SamplingParams, Scheduler, TokenOutput
from omlx.scheduler.plan import KVLoad, PrefillChunk, SchedulerOutput
from tests.fixtures.budget_view import BudgetView


def _request(rid: str, n: int, arrival: float, **kw) -> Request:
    return Request(
        rid, tuple(range(3, 3 + n)), SamplingParams(max_tokens=50), arrival_s=arrival, **kw
    )


def _scheduler() -> Scheduler:
    return Scheduler(max_running=4, max_waiting=8, prefill_step_size=64)


def test_the_plan_is_frozen_and_carries_cached_tokens_and_first_chunks() -> None:
    scheduler = _scheduler()
    scheduler.add(_request("a", 100, 1.0))
    view = BudgetView(budget=10**6, cached={"a": 48})
    plan = scheduler.schedule(view)
    assert [r.request_id for r in plan.admitted] == ["a"] and plan.cached == {"a": 48}
    # The first chunk starts after the cached tokens: 52 left, one 52-token chunk.
    assert view.settled[-1][1] == ["a"] and plan.prefill_cap is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prefill_cap = 3  # type: ignore[misc]


def test_a_step_short_of_memory_sends_the_newest_back_unstarted_not_ended() -> None:
    """Two running prompts' chunks fit when capped to the floor, a third's does not
    even then: the request admitted in this step goes back to the head of the queue,
    the others run capped, and nobody is ended."""
    scheduler = _scheduler()
    for rid, t in (("a", 1.0), ("b", 2.0)):
        scheduler.add(_request(rid, 200, t))
    view = BudgetView(budget=64)
    first = scheduler.schedule(view)
    assert [r.request_id for r in first.admitted] == ["a", "b"]
    chunks = [PrefillChunk("a", 64, 128, 136), PrefillChunk("b", 64, 128, 136)]
    scheduler.add(_request("c", 200, 3.0))
    plan = scheduler.schedule(view, chunks)
    assert plan.admitted == () and plan.preempted == () and plan.ended == ()
    assert plan.prefill_cap == 32 and scheduler.num_waiting == 1 and view.sent == ["c"]
    # Once a running request is gone, the waiting one starts.
    scheduler.finish("a", RequestStatus.FINISHED_ABORTED)
    plan = scheduler.schedule(view, chunks[1:])
    assert [r.request_id for r in plan.admitted] == ["c"]


def test_an_older_request_is_preempted_when_the_running_chunks_do_not_fit() -> None:
    scheduler = _scheduler()
    for rid, t in (("a", 1.0), ("b", 2.0)):
        scheduler.add(_request(rid, 200, t))
    scheduler.schedule(BudgetView(budget=10**6))
    chunks = [PrefillChunk("a", 64, 128, 136), PrefillChunk("b", 64, 128, 136)]
    plan = scheduler.schedule(BudgetView(budget=32), chunks)
    assert plan.preempted == ("b",) and plan.ended == () and plan.leaving == ("b",)
    assert scheduler.running_ids() == ["a"] and scheduler.preemptions["memory"] == 1


def test_only_a_lone_request_whose_chunk_cannot_fit_is_ended() -> None:
    scheduler = _scheduler()
    scheduler.add(_request("a", 200, 1.0))
    plan = scheduler.schedule(BudgetView(budget=8))
    assert plan.ended == ("a",) and plan.admitted == () and not scheduler.has_work


def test_a_lone_request_gives_way_to_another_model_s_work_instead_of_ending() -> None:
    """The memory is the process's (issue 40, defect 3): while another model runs,
    a lone request here whose chunk cannot fit goes back to the queue, unstarted
    or preempted, and starts again once it fits."""
    scheduler = _scheduler()
    scheduler.add(_request("a", 200, 1.0))
    busy = BudgetView(budget=8, others_running=True)
    plan = scheduler.schedule(busy)
    assert plan.ended == () and plan.admitted == () and busy.sent == ["a"]
    assert scheduler.num_waiting == 1
    plan = scheduler.schedule(BudgetView(budget=10**6))
    assert [r.request_id for r in plan.admitted] == ["a"]
    # Mid-prompt, it is preempted (it resumes from its cache hit), not ended.
    plan = scheduler.schedule(busy, [PrefillChunk("a", 64, 128, 136)])
    assert plan.preempted == ("a",) and plan.ended == () and scheduler.num_waiting == 1


def test_kv_over_capacity_preempts_the_newest_without_images() -> None:
    scheduler = _scheduler()
    scheduler.add(_request("a", 40, 1.0))
    scheduler.add(_request("b", 40, 2.0))
    scheduler.add(_request("img", 40, 3.0, images=object()))
    view = BudgetView(budget=10**6, kv_capacity=120)
    scheduler.schedule(view)
    scheduler.update_from_output([TokenOutput(rid, 9) for rid in ("a", "img", "b")])
    plan = scheduler.schedule(view)
    # 3 x 41 tokens > 120: "b" (the newest without images) waits, its output kept.
    assert plan.preempted == ("b",) and isinstance(plan, SchedulerOutput)
    assert scheduler.preemptions["kv_capacity"] == 1
    again = scheduler.schedule(BudgetView(budget=10**6))
    assert again.admitted[0].prompt_ids[-1] == 9 and again.admitted[0].num_resumed_tokens == 1


def test_kv_capacity_counts_the_batch_padded_to_its_longest_row() -> None:
    """A 100-token prompt and two 5-token ones: 110 tokens, but their batch holds
    3 rows x 101 columns (mlx-lm left-pads every row to the longest), 102 through
    the step (its token a row) > 300."""
    scheduler = _scheduler()
    for rid, n, at in (("long", 100, 1.0), ("s1", 5, 2.0), ("s2", 5, 3.0)):
        scheduler.add(_request(rid, n, at))
    view = BudgetView(budget=10**6, kv_capacity=300)
    scheduler.schedule(view)
    scheduler.update_from_output([TokenOutput(rid, 9) for rid in ("long", "s1", "s2")])
    assert scheduler.kv_load.allocated == 3 * 102 and scheduler.kv_load.tokens == 101 + 2 * 6
    assert scheduler.schedule(view).preempted == ("s2",)
    assert scheduler.kv_load.allocated == 2 * 102


def test_kv_capacity_counts_each_row_grown_to_mlx_lms_allocation_step() -> None:
    """mlx-lm's caches grow 256 columns at a time: three rows padded to 101 tokens
    hold up to 3 x (101 + 256) columns through a step (its token, then up to 255
    columns of growth), over a capacity of 800 that their 303 padded tokens fit; two
    rows (714) fit. A lone 1-token row counts 257 columns."""
    scheduler = Scheduler(max_running=4, max_waiting=8, prefill_step_size=64, kv_step=256)
    for rid, n, at in (("long", 100, 1.0), ("s1", 5, 2.0), ("s2", 5, 3.0)):
        scheduler.add(_request(rid, n, at))
    view = BudgetView(budget=10**6, kv_capacity=800)
    scheduler.schedule(view)
    scheduler.update_from_output([TokenOutput(rid, 9) for rid in ("long", "s1", "s2")])
    assert scheduler.kv_load.allocated == 3 * (101 + 256)
    assert scheduler.schedule(view).preempted == ("s2",)
    assert scheduler.kv_load.allocated == 2 * (101 + 256)
    assert KVLoad(step=256).with_row(1).allocated == 257 and KVLoad(step=256).allocated == 0


def test_drafts_are_verified_only_when_their_width_fits() -> None:
    """The plan says whether the decoding rows speculate: their verification width
    is gated like a chunk (the requests still decode, one token each, if not)."""
    scheduler = _scheduler()
    scheduler.add(_request("a", 40, 1.0))
    scheduler.schedule(BudgetView(budget=10**6))
    drafts = [PrefillChunk("a", 9, 49, 9), PrefillChunk("gone", 9, 49, 9)]
    assert scheduler.schedule(BudgetView(budget=9), (), drafts).speculate
    assert not scheduler.schedule(BudgetView(budget=8), (), drafts).speculate


def _burst(scheduler: Scheduler, opening: int, *tails: int) -> None:
    """Requests arriving together whose prompts open with the same ``opening``
    tokens, each followed by a tail of its own."""
    for i, tail in enumerate(tails):
        own = tuple(1000 * (i + 1) + j for j in range(tail))
        scheduler.add(Request(f"r{i}", tuple(range(3, 3 + opening)) + own, SamplingParams()))


def test_a_burst_shares_its_opening_from_the_shortest_hit_gated_like_a_chunk() -> None:
    scheduler = Scheduler(max_running=4, max_waiting=8, prefill_step_size=64, share_openings=True)
    _burst(scheduler, 40, 10, 12, 9)
    view = BudgetView(budget=10**6, cached={"r0": 16, "r1": 32})
    plan = scheduler.schedule(view)
    (opening,) = plan.openings
    # All three open with the same 40 tokens; r2 has nothing cached: the opening
    # runs once from 0, and the gate was asked for exactly that forward.
    assert sorted(opening.request_ids) == ["r0", "r1", "r2"]
    assert (opening.start, opening.end) == (0, 40)
    assert view.shares_asked == [(40, 0)]


def test_a_refused_opening_is_not_planned_and_nobody_is_ended() -> None:
    scheduler = Scheduler(max_running=4, max_waiting=8, prefill_step_size=64, share_openings=True)
    _burst(scheduler, 40, 10, 12)
    # Each request's own chunk (at most 64 tokens) fits; the 40-token opening does not.
    view = BudgetView(budget=10**6)
    view.may_share = lambda num_tokens, num_cached, num_running: False  # type: ignore[method-assign]
    plan = scheduler.schedule(view)
    assert plan.openings == () and len(plan.admitted) == 2 and plan.ended == ()


def test_no_openings_for_a_runner_that_cannot_share_or_prompts_that_differ() -> None:
    plain = Scheduler(max_running=4, max_waiting=8, prefill_step_size=64)
    _burst(plain, 40, 10, 12)
    assert plain.schedule(BudgetView(budget=10**6)).openings == ()
    sharing = Scheduler(max_running=4, max_waiting=8, prefill_step_size=64, share_openings=True)
    _burst(sharing, 0, 50, 50)  # nothing in common
    assert sharing.schedule(BudgetView(budget=10**6)).openings == ()


def test_requests_that_left_reach_the_runner_through_the_next_plan_once() -> None:
    """Finished by token, ended by a stop string or an abort while running: the next
    plan's ``finished`` names each once (the runner drops them before its forward);
    a request aborted while still queued never reached the runner."""
    scheduler = Scheduler(max_running=3, max_waiting=8, prefill_step_size=64)
    one = Request("a", tuple(range(3, 13)), SamplingParams(max_tokens=1), arrival_s=1.0)
    scheduler.add(one)
    for rid, t in (("b", 2.0), ("c", 3.0), ("queued", 4.0)):
        scheduler.add(_request(rid, 10, t))
    scheduler.schedule(BudgetView(budget=10**6))
    updates = scheduler.update_from_output([TokenOutput("a", 7), TokenOutput("b", 8)])
    assert [u.status for u in updates] == [RequestStatus.FINISHED_LENGTH, RequestStatus.RUNNING]
    assert scheduler.finish("b", RequestStatus.FINISHED_STOPPED) is RequestStatus.RUNNING
    assert scheduler.finish("queued", RequestStatus.FINISHED_ABORTED) is RequestStatus.WAITING
    plan = scheduler.schedule(BudgetView(budget=10**6))
    assert plan.finished == ("a", "b") and set(plan.leaving) == {"a", "b"}
    assert scheduler.running_ids() == ["c"]
    assert scheduler.schedule(BudgetView(budget=10**6)).finished == ()


def _with_images(rid: str, arrival: float) -> Request:
    """A prompt with images (the scheduler only asks whether it has any)."""
    return _request(rid, 40, arrival, images=object())


def test_an_image_prompt_whose_encode_does_not_fit_waits_at_the_head_unstarted() -> None:
    """Issue 40, item 1: the vision tower runs when a request starts, so the gate's
    "wait" on its encode keeps it out of the step (no chunk, no placement) and at
    the head of the queue; the next step that passes it starts it."""
    scheduler = _scheduler()
    scheduler.add(_with_images("v", 1.0))
    scheduler.add(_request("t", 40, 2.0))
    view = BudgetView(budget=10**6, encode="wait")
    plan = scheduler.schedule(view)
    assert [r.request_id for r in plan.admitted] == ["t"] and plan.ended == ()
    assert [c.request_id for c in plan.chunks] == ["t"] and "v" not in plan.placements.where
    assert view.encodes_asked == ["v"] and scheduler.num_waiting == 1
    view.encode = "run"
    plan = scheduler.schedule(view, [PrefillChunk("t", 39, 40, 39)])
    assert [r.request_id for r in plan.admitted] == ["v"]


def test_an_image_prompt_whose_encode_cannot_fit_alone_is_ended() -> None:
    scheduler = _scheduler()
    scheduler.add(_with_images("v", 1.0))
    plan = scheduler.schedule(BudgetView(budget=10**6, encode="end"))
    assert plan.admitted == () and plan.ended == ("v",) and "v" in plan.leaving
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0


def test_no_image_encode_runs_in_a_step_that_holds_prefill() -> None:
    """The gate held every chunk (others decode): an image prompt admitted in that
    step goes back to the queue without its encode being asked about, let alone run."""
    scheduler = _scheduler()
    scheduler.add(_request("a", 200, 1.0))
    view = BudgetView(budget=10, hold=True)
    scheduler.schedule(BudgetView(budget=10**6))
    scheduler.add(_with_images("v", 2.0))
    plan = scheduler.schedule(view, [PrefillChunk("a", 64, 64, 200)])
    assert plan.prefill_cap == 0 and plan.admitted == () and plan.ended == ()
    assert view.encodes_asked == [] and scheduler.num_waiting == 1
