"""The step contract (issue 28): ``Scheduler.schedule(memory, chunks)`` returns a
frozen plan: who starts (with their cached tokens), who is preempted, who is
ended, and the prefill cap. Pure: the memory view here is a budget of prefill
tokens per step and a KV capacity, answered by the real ``shape_prefill`` rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from omlx.memory.throttle import PrefillShape, shape_prefill
from omlx.scheduler import Request, RequestStatus, SamplingParams, Scheduler, TokenOutput
from omlx.scheduler.plan import PrefillChunk, SchedulerOutput


class BudgetView:
    """A MemoryView whose step fits ``budget`` prefill tokens in all (chunks of
    a step add up) and whose KV holds ``kv_capacity`` tokens."""

    def __init__(self, budget: int, kv_capacity: int = 10**9, cached: dict | None = None):
        self.budget = budget
        self.kv_capacity = kv_capacity
        self.cached = cached or {}
        self.settled: list[tuple[PrefillShape, list[str]]] = []
        self.sent: list[str] = []

    def kv_over_capacity(self, num_tokens_in_flight: int) -> bool:
        return num_tokens_in_flight > self.kv_capacity

    def start_admission(self, chunks: Sequence[PrefillChunk]) -> None:
        pass

    def can_admit(self, request: Request, num_running: int) -> bool:
        return True

    def cached_tokens(self, request: Request) -> int:
        return self.cached.get(request.request_id, 0)

    def sent_back(self, request: Request) -> None:
        self.sent.append(request.request_id)

    def shape_prefill(self, chunks: Sequence[PrefillChunk], num_running: int) -> PrefillShape:
        return shape_prefill(chunks, lambda tokens, _cached: tokens <= self.budget, may_hold=False)

    def settle(self, shape: PrefillShape, chunks: Sequence[PrefillChunk]) -> None:
        self.settled.append((shape, [c.request_id for c in chunks]))

    def may_speculate(self, chunks: Sequence[PrefillChunk]) -> bool:
        return sum(c.num_tokens for c in chunks) <= self.budget


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


def test_drafts_are_verified_only_when_their_width_fits() -> None:
    """The plan says whether the decoding rows speculate: their verification width
    is gated like a chunk (the requests still decode, one token each, if not)."""
    scheduler = _scheduler()
    scheduler.add(_request("a", 40, 1.0))
    scheduler.schedule(BudgetView(budget=10**6))
    drafts = [PrefillChunk("a", 9, 49, 9), PrefillChunk("gone", 9, 49, 9)]
    assert scheduler.schedule(BudgetView(budget=9), (), drafts).speculate
    assert not scheduler.schedule(BudgetView(budget=8), (), drafts).speculate
