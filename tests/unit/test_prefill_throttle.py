"""The gate's order of resort (issue 27, defect 5): cap the chunks, then wait
for decoding requests, then end only what does not fit at the floor."""

from __future__ import annotations

from dataclasses import dataclass

from omlx.memory.throttle import MIN_PREFILL_CHUNK, shape_prefill


@dataclass(frozen=True)
class Chunk:
    request_id: str
    num_tokens: int
    num_context_tokens: int
    indivisible: bool = False


def room_for(tokens: int):
    """A gate that lets a step run up to ``tokens`` prefill tokens in all."""
    return lambda ahead, _cached: ahead <= tokens


PLAN = [Chunk("a", 512, 1024), Chunk("b", 512, 512)]


def test_a_plan_that_fits_runs_as_planned() -> None:
    shape = shape_prefill(PLAN, room_for(1024), may_hold=True)
    assert shape.cap is None and shape.ended == () and not shape.throttled


def test_chunks_are_capped_at_the_largest_halving_that_fits() -> None:
    shape = shape_prefill(PLAN, room_for(300), may_hold=True)
    assert shape.cap == 128 and shape.throttled and shape.ended == ()


def test_below_the_floor_prefill_waits_while_others_decode() -> None:
    shape = shape_prefill(PLAN, room_for(MIN_PREFILL_CHUNK - 1), may_hold=True)
    assert shape.held and shape.ended == ()


def test_without_decoding_requests_only_the_chunks_that_do_not_fit_end() -> None:
    shape = shape_prefill(PLAN, room_for(MIN_PREFILL_CHUNK), may_hold=False)
    assert shape.cap == MIN_PREFILL_CHUNK and shape.ended == ("b",)
    shape = shape_prefill(PLAN, room_for(0), may_hold=False)
    assert shape.ended == ("a", "b")


def test_the_gate_sees_each_chunks_cached_tokens() -> None:
    seen = []

    def fits(ahead: int, cached: int) -> bool:
        seen.append((ahead, cached))
        return True

    shape_prefill(PLAN, fits, may_hold=False)
    assert seen == [(512, 512), (1024, 0)]


def test_a_whole_prompt_chunk_is_never_capped_the_others_are() -> None:
    # A whole-prompt image prompt's tokens attend as one forward (mlx-vlm's): capped,
    # it would answer otherwise. The other chunks shrink around it.
    plan = [Chunk("w", 512, 512, indivisible=True), Chunk("b", 512, 512)]
    shape = shape_prefill(plan, room_for(600), may_hold=True)
    assert shape.cap == 64 and shape.ended == ()


def test_a_whole_prompt_chunk_that_does_not_fit_waits_or_ends_never_runs_capped() -> None:
    whole = [Chunk("w", 512, 512, indivisible=True)]
    assert shape_prefill(whole, room_for(511), may_hold=True).held
    shape = shape_prefill(whole, room_for(511), may_hold=False)
    assert shape.ended == ("w",)
    # A plain chunk of the same size is capped and runs.
    assert shape_prefill([Chunk("p", 512, 512)], room_for(511), may_hold=False).cap == 256
