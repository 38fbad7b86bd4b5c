"""Scheduler admission, capacity, abort and finish reasons, driven like ModelEngine.step:
the real plan, executed by a runner without MLX, and the real update."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import pytest

from omlx.engine.model_engine import Runner
from omlx.engine.runner import BatchRunner
from omlx.errors import QueueFullError
from omlx.scheduler import (
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    TokenOutput,
)
from omlx.scheduler.plan import SchedulerOutput
from tests.fixtures.budget_view import BudgetView
from tests.fixtures.fake_runner import FakeRunner, Step, engine_step


def make_request(rid: str, max_tokens: int = 4, stop_token_ids: Iterable[int] = ()) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=frozenset(stop_token_ids))
    return Request(rid, prompt_ids=(1, 2, 3), sampling=sampling)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 200) -> list[Step]:
    """The steps until every request finished. The engine's next step, whose plan
    only drops the last finished ones from the runner, runs too (no token, no
    update) and is not returned."""
    steps: list[Step] = []
    while scheduler.num_waiting or scheduler.num_running:
        assert len(steps) < max_steps, "scheduler never drained"
        steps.append(engine_step(scheduler, runner))
    assert engine_step(scheduler, runner) == ([], [], [])
    assert not scheduler.has_work and not runner.has_work
    return steps


def steps_producing(steps: list[Step], rid: str) -> list[int]:
    return [
        i for i, (_, outputs, _) in enumerate(steps) if any(o.request_id == rid for o in outputs)
    ]


# ---- the runner protocol ----------------------------------------------------


def protocol_members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)


def parameter_names(member: Callable[..., object]) -> list[str]:
    return list(inspect.signature(member).parameters)


@pytest.mark.parametrize("implementation", [FakeRunner, BatchRunner])
def test_the_fake_and_the_real_runner_have_the_engine_runner_shape(implementation: type) -> None:
    """What ModelEngine asks of a runner (model_engine.Runner): the fake offers the
    same members with the same parameters as BatchRunner, so the loop below is the
    engine's loop."""
    for name in protocol_members(Runner):
        assert hasattr(implementation, name), name
        wanted = getattr(Runner, name, None)
        if callable(wanted):  # the methods (has_work is a property, num_draft an int)
            assert parameter_names(getattr(implementation, name)) == parameter_names(wanted), name


def test_the_plan_s_prefill_cap_is_what_the_runner_runs() -> None:
    """Two 129-token prompts, 64-token chunks: with room for both chunks a step, the
    first tokens come in the second step; with room for 64 tokens a step the gate
    caps each chunk to 32 and they come in the fourth. A prompt the prefix index
    holds all but its last token of starts decoding in the step it is admitted."""
    for budget, first_token_step in ((10**6, 1), (64, 3)):
        scheduler = Scheduler(max_running=2, max_waiting=2, prefill_step_size=64)
        runner = FakeRunner(prefill_step_size=64)
        view = BudgetView(budget=budget)
        for rid in ("a", "b"):
            scheduler.add(Request(rid, tuple(range(129)), SamplingParams(max_tokens=2)))
        steps = [engine_step(scheduler, runner, view) for _ in range(first_token_step + 1)]
        assert steps_producing(steps, "a") == steps_producing(steps, "b") == [first_token_step]
        assert [shape.cap for shape, _ in view.settled][:1] == [None if budget > 128 else 32]

    scheduler = Scheduler(max_running=1, max_waiting=1, prefill_step_size=64)
    scheduler.add(Request("hit", tuple(range(129)), SamplingParams(max_tokens=2)))
    admitted, outputs, _ = engine_step(
        scheduler, FakeRunner(prefill_step_size=64), BudgetView(budget=64, cached={"hit": 128})
    )
    assert [r.request_id for r in admitted] == ["hit"] and [o.request_id for o in outputs] == [
        "hit"
    ]


def test_a_one_forward_prompt_is_planned_as_its_whole_rest_indivisible() -> None:
    """A whole-prompt image prompt (mlx-vlm's model attends it as one forward) is
    planned, and so gated, as its whole prompt in one chunk that no cap may split;
    other prompts take a prefill step."""
    scheduler = Scheduler(
        max_running=2,
        max_waiting=2,
        prefill_step_size=64,
        one_forward=lambda r: r.request_id == "w",
    )
    for rid in ("w", "t"):
        scheduler.add(Request(rid, tuple(range(129)), SamplingParams(max_tokens=2)))
    plan = scheduler.schedule(BudgetView(budget=10**6))
    chunks = {c.request_id: (c.num_tokens, c.indivisible) for c in plan.chunks}
    assert chunks == {"w": (129, True), "t": (64, False)}


# ---- admission ------------------------------------------------------------


def test_admits_in_arrival_order_whatever_finishes_first():
    scheduler = Scheduler(max_running=2, max_waiting=10)
    lengths = {"r0": 5, "r1": 1, "r2": 3, "r3": 1, "r4": 2, "r5": 1}
    for rid, n in lengths.items():
        scheduler.add(make_request(rid, max_tokens=n))

    steps = run_to_completion(scheduler, FakeRunner())

    admitted = [r.request_id for admitted, _, _ in steps for r in admitted]
    assert admitted == list(lengths)


def test_never_more_than_max_running_at_any_step():
    scheduler = Scheduler(max_running=3, max_waiting=20)
    runner = FakeRunner()
    for i in range(12):
        scheduler.add(make_request(f"r{i}", max_tokens=1 + i % 4))

    peak = 0
    while scheduler.has_work:
        assert scheduler.num_running <= 3
        running_before = set(scheduler.running_ids())
        admitted, outputs, _ = engine_step(scheduler, runner)
        producing = {o.request_id for o in outputs}
        assert producing == running_before | {r.request_id for r in admitted}
        assert len(producing) <= 3
        assert scheduler.num_running <= 3
        peak = max(peak, len(producing))
    assert peak == 3
    assert not runner.has_work


def test_queued_request_starts_in_the_step_after_a_slot_frees():
    scheduler = Scheduler(max_running=1, max_waiting=5)
    scheduler.add(make_request("a", max_tokens=3))
    scheduler.add(make_request("b", max_tokens=2))
    scheduler.add(make_request("c", max_tokens=1))

    steps = run_to_completion(scheduler, FakeRunner())

    assert steps_producing(steps, "a") == [0, 1, 2]
    assert steps_producing(steps, "b") == [3, 4]
    assert steps_producing(steps, "c") == [5]
    assert len(steps) == 6


def test_schedule_fills_every_free_slot_at_once():
    scheduler = Scheduler(max_running=3, max_waiting=5)
    for rid in ("a", "b", "c", "d"):
        scheduler.add(make_request(rid))

    assert [r.request_id for r in scheduler.admit()] == ["a", "b", "c"]
    assert (scheduler.num_running, scheduler.num_waiting) == (3, 1)
    assert scheduler.admit() == []


def arriving(rid: str, at: float) -> Request:
    return Request(rid, prompt_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4), arrival_s=at)


def test_a_burst_arriving_while_idle_is_admitted_as_one_batch():
    """Arrivals 3 ms apart with a 5 ms quiet window: nothing starts until 5 ms after
    the last one, then all start together."""
    scheduler = Scheduler(max_running=8, max_waiting=8, gather_s=0.005, gather_max_s=0.025)
    scheduler.add(arriving("a", 100.000))
    assert scheduler.ready_in(100.001) == pytest.approx(0.004)
    assert scheduler.admit(now=100.001) == []
    scheduler.add(arriving("b", 100.003))
    scheduler.add(arriving("c", 100.006))
    assert scheduler.admit(now=100.010) == []
    assert scheduler.ready_in(100.010) == pytest.approx(0.001)
    admitted = scheduler.admit(now=100.0111)
    assert [r.request_id for r in admitted] == ["a", "b", "c"]
    assert scheduler.ready_in(100.0111) == 0.0


def test_a_steady_trickle_starts_no_later_than_the_cap():
    """An arrival every 4 ms never leaves a 5 ms quiet gap: the first request still
    starts 25 ms after it came, with everything that came by then."""
    scheduler = Scheduler(max_running=16, max_waiting=16, gather_s=0.005, gather_max_s=0.025)
    for i in range(7):
        scheduler.add(arriving(f"r{i}", 10.0 + 0.004 * i))
        assert scheduler.admit(now=10.0 + 0.004 * i + 0.001) == []
    assert scheduler.ready_in(10.0249) > 0
    assert len(scheduler.admit(now=10.025)) == 7


def test_arrivals_while_others_run_are_admitted_at_once():
    """Gathering is for an idle engine only: once something runs, a new request
    starts at the next step, as before."""
    scheduler = Scheduler(max_running=4, max_waiting=4, gather_s=0.005, gather_max_s=0.025)
    scheduler.add(arriving("first", 0.0))
    assert [r.request_id for r in scheduler.admit(now=1.0)] == ["first"]
    scheduler.add(arriving("second", 2.0))
    assert scheduler.ready_in(2.0) == 0.0
    assert [r.request_id for r in scheduler.admit(now=2.0)] == ["second"]


def test_a_zero_window_starts_every_request_at_once():
    scheduler = Scheduler(max_running=4, max_waiting=4)
    scheduler.add(arriving("a", 5.0))
    assert scheduler.ready_in(5.0) == 0.0
    assert [r.request_id for r in scheduler.admit(now=5.0)] == ["a"]


def test_max_running_must_be_positive():
    with pytest.raises(ValueError, match="max_running"):
        Scheduler(max_running=0, max_waiting=1)


# ---- capacity ---------------------------------------------------------------


def test_capacity_is_running_plus_waiting_and_the_boundary_is_accepted():
    scheduler = Scheduler(max_running=2, max_waiting=1)
    assert scheduler.capacity == 3
    for rid in ("a", "b", "c"):
        scheduler.add(make_request(rid))

    with pytest.raises(QueueFullError) as info:
        scheduler.add(make_request("d"))

    assert info.value.http_status == 503
    assert info.value.headers() == {"Retry-After": "1"}
    assert scheduler.num_waiting == 3


def test_queue_full_counts_running_requests_too():
    scheduler = Scheduler(max_running=2, max_waiting=1)
    for rid in ("a", "b", "c"):
        scheduler.add(make_request(rid))
    scheduler.admit()
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)

    with pytest.raises(QueueFullError):
        scheduler.add(make_request("d"))


def test_room_frees_when_a_request_finishes():
    scheduler = Scheduler(max_running=1, max_waiting=0)
    runner = FakeRunner()
    scheduler.add(make_request("a", max_tokens=1))
    with pytest.raises(QueueFullError):
        scheduler.add(make_request("b"))

    engine_step(scheduler, runner)

    scheduler.add(make_request("b"))
    assert scheduler.num_waiting == 1


def test_duplicate_ids_are_rejected_while_waiting_and_while_running():
    scheduler = Scheduler(max_running=1, max_waiting=5)
    scheduler.add(make_request("a"))
    with pytest.raises(ValueError, match="duplicate"):
        scheduler.add(make_request("a"))

    scheduler.admit()
    with pytest.raises(ValueError, match="duplicate"):
        scheduler.add(make_request("a"))
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 0)


# ---- abort -------------------------------------------------------------------


def test_abort_waiting_request_returns_waiting_and_it_never_runs():
    scheduler = Scheduler(max_running=1, max_waiting=5)
    runner = FakeRunner()
    scheduler.add(make_request("a", max_tokens=2))
    scheduler.add(make_request("b", max_tokens=2))
    scheduler.add(make_request("c", max_tokens=2))

    assert scheduler.finish("b", RequestStatus.FINISHED_ABORTED) is RequestStatus.WAITING
    steps = run_to_completion(scheduler, runner)

    assert steps_producing(steps, "b") == []
    assert [r.request_id for admitted, _, _ in steps for r in admitted] == ["a", "c"]


def test_abort_running_request_returns_running_and_frees_its_slot():
    scheduler = Scheduler(max_running=1, max_waiting=5)
    runner = FakeRunner()
    scheduler.add(make_request("a", max_tokens=10))
    scheduler.add(make_request("b", max_tokens=1))
    engine_step(scheduler, runner)

    assert scheduler.finish("a", RequestStatus.FINISHED_ABORTED) is RequestStatus.RUNNING
    runner.remove(["a"])  # ModelEngine._abort does this for RUNNING
    admitted, outputs, updates = engine_step(scheduler, runner)

    assert [r.request_id for r in admitted] == ["b"]
    assert [o.request_id for o in outputs] == ["b"]
    assert [(u.request_id, u.status) for u in updates] == [("b", RequestStatus.FINISHED_LENGTH)]
    assert scheduler.running_ids() == []


def test_abort_of_unknown_or_finished_request_returns_none():
    scheduler = Scheduler(max_running=1, max_waiting=5)
    scheduler.add(make_request("a", max_tokens=1))
    run_to_completion(scheduler, FakeRunner())

    assert scheduler.finish("a", RequestStatus.FINISHED_ABORTED) is None
    assert scheduler.finish("nope", RequestStatus.FINISHED_ABORTED) is None

    scheduler.add(make_request("b"))
    assert scheduler.finish("b", RequestStatus.FINISHED_ABORTED) is RequestStatus.WAITING
    assert scheduler.finish("b", RequestStatus.FINISHED_ABORTED) is None


def test_aborted_request_gets_no_update_for_a_token_already_produced():
    scheduler = Scheduler(max_running=2, max_waiting=5)
    runner = FakeRunner()
    scheduler.add(make_request("a", max_tokens=10))
    scheduler.add(make_request("b", max_tokens=10))
    engine_step(scheduler, runner)

    outputs = runner.execute(SchedulerOutput()).tokens  # a token for "a" is made ...
    scheduler.finish("a", RequestStatus.FINISHED_ABORTED)  # ... when the abort lands
    updates = scheduler.update_from_output(outputs)

    assert {o.request_id for o in outputs} == {"a", "b"}
    assert [u.request_id for u in updates] == ["b"]
    assert updates[0].num_output_tokens == 2


# ---- finish reasons -----------------------------------------------------------


def test_stop_token_finishes_stopped_and_is_not_visible():
    scheduler = Scheduler(max_running=1, max_waiting=1)
    runner = FakeRunner(scripts={"a": [5, 6, 99, 7]})
    scheduler.add(make_request("a", max_tokens=10, stop_token_ids={99}))

    steps = run_to_completion(scheduler, runner)

    updates = [u for _, _, ups in steps for u in ups]
    assert [u.token_id for u in updates] == [5, 6, 99]
    assert [u.visible for u in updates] == [True, True, False]
    assert [u.status for u in updates] == [
        RequestStatus.RUNNING,
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_STOPPED,
    ]
    assert [u.num_output_tokens for u in updates] == [1, 2, 3]
    assert not runner.has_work


def test_max_tokens_finishes_with_length_at_exactly_max_tokens_outputs():
    scheduler = Scheduler(max_running=1, max_waiting=1)
    scheduler.add(make_request("a", max_tokens=4))

    steps = run_to_completion(scheduler, FakeRunner())

    updates = [u for _, _, ups in steps for u in ups]
    assert [u.num_output_tokens for u in updates] == [1, 2, 3, 4]
    assert [u.status for u in updates[:3]] == [RequestStatus.RUNNING] * 3
    assert updates[-1].status is RequestStatus.FINISHED_LENGTH
    assert updates[-1].status.finish_reason == "length"
    assert all(u.visible for u in updates)


def test_stop_token_at_the_length_limit_counts_as_stop():
    scheduler = Scheduler(max_running=1, max_waiting=1)
    runner = FakeRunner(scripts={"a": [5, 99]})
    scheduler.add(make_request("a", max_tokens=2, stop_token_ids={99}))

    steps = run_to_completion(scheduler, runner)

    last = steps[-1][2][0]
    assert (last.status, last.visible, last.num_output_tokens) == (
        RequestStatus.FINISHED_STOPPED,
        False,
        2,
    )


def test_each_request_counts_its_own_outputs():
    scheduler = Scheduler(max_running=2, max_waiting=2)
    scheduler.add(make_request("a", max_tokens=3))
    scheduler.add(make_request("b", max_tokens=5))

    steps = run_to_completion(scheduler, FakeRunner())

    last = {u.request_id: u for _, _, ups in steps for u in ups}
    assert last["a"].num_output_tokens == 3
    assert last["b"].num_output_tokens == 5
    assert len(steps) == 5


# ---- value types ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "greedy"),
    [
        (SamplingParams(), False),
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=0.7, top_k=1), True),
        (SamplingParams(temperature=0.7, top_k=40), False),
        (SamplingParams(temperature=0.01), False),
    ],
)
def test_sampling_params_is_greedy(params, greedy):
    assert params.is_greedy is greedy


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
        (RequestStatus.FINISHED_ERROR, "error"),
    ],
)
def test_request_status_finish_reason(status, reason):
    assert status.finish_reason == reason
    assert status.is_finished is (reason is not None)


def test_a_preempted_request_waits_at_the_head_and_resumes_its_count() -> None:
    """Preemption puts the newest request first in the queue with its output so far
    appended to its prompt; its max_tokens count and KV tokens carry on, not restart."""
    scheduler = Scheduler(max_running=2, max_waiting=4)
    old = Request("old", (1, 2, 3), SamplingParams(max_tokens=5), arrival_s=1.0)
    new = Request("new", (4, 5), SamplingParams(max_tokens=3), arrival_s=2.0)
    later = Request("later", (6,), SamplingParams(max_tokens=3), arrival_s=3.0)
    for r in (old, new):
        scheduler.add(r)
    assert scheduler.admit() == [old, new]
    scheduler.add(later)
    scheduler.update_from_output([TokenOutput("old", 7), TokenOutput("new", 8)])
    assert scheduler.newest_running() == "new"
    assert scheduler.newest_running(exclude={"new"}) == "old"

    resumed = scheduler.preempt("new")
    assert resumed.prompt_ids == (4, 5, 8) and resumed.num_resumed_tokens == 1
    assert resumed.resumed_output_ids == (8,)
    assert scheduler.kv_load.tokens == 4  # old: 3 prompt + 1 output
    # Back at the head of the queue, before the request that arrived after it.
    admitted = scheduler.admit()
    assert admitted == [resumed]
    assert scheduler.kv_load.tokens == 4 + 3
    updates = scheduler.update_from_output([TokenOutput("new", 9), TokenOutput("new", 10)])
    assert [u.num_output_tokens for u in updates] == [2, 3]
    assert updates[-1].status is RequestStatus.FINISHED_LENGTH
    assert scheduler.admit() == [later]
