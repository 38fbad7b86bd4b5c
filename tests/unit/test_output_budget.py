"""The output budget: what a request asked, within the room its prompt leaves."""

from __future__ import annotations

import pytest

from omlx.api.output_budget import CLAMPED_HEADER, clamped_header, output_budget
from omlx.api.prompts import SamplingRequest
from omlx.errors import ContextLengthExceededError


def test_a_budget_that_fits_is_what_was_asked() -> None:
    budget = output_budget("m", 8192, 1000, SamplingRequest(max_tokens=500), 4096)
    assert (budget.max_tokens, budget.clamped) == (500, False)
    # Nothing asked: the default, within the room.
    assert output_budget("m", 8192, 1000, SamplingRequest(), 4096).max_tokens == 4096
    assert output_budget("m", 8192, 7000, SamplingRequest(), 4096).max_tokens == 1192


def test_an_agents_fixed_32000_is_clamped_to_the_room_left_and_reported() -> None:
    budget = output_budget("m", 8192, 392, SamplingRequest(max_tokens=32000), 4096)
    assert (budget.max_tokens, budget.requested) == (7800, 32000)
    assert clamped_header("r", [budget]) == {
        CLAMPED_HEADER: "requested=32000; granted=7800; prompt_tokens=392; context_window=8192"
    }
    fits = output_budget("m", 8192, 392, SamplingRequest(max_tokens=10), 4096)
    assert clamped_header("r", [fits]) == {}


def test_a_prompt_that_leaves_no_room_is_refused_naming_the_window() -> None:
    with pytest.raises(
        ContextLengthExceededError, match=r"the prompt is 8192 tokens.*8192"
    ) as info:
        output_budget("m", 8192, 8192, SamplingRequest(max_tokens=1), 4096)
    assert info.value.param == "messages"


def test_strict_max_tokens_refuses_what_a_clamp_would_serve() -> None:
    req = SamplingRequest(max_tokens=32000, max_tokens_param="max_output_tokens")
    with pytest.raises(ContextLengthExceededError, match="at most 7800") as info:
        output_budget("m", 8192, 392, req, 4096, strict=True)
    assert info.value.param == "max_output_tokens"
    assert "strict_max_tokens" in info.value.message


def test_a_smaller_window_the_request_asks_for_bounds_the_room() -> None:
    req = SamplingRequest(max_tokens=500, context_limit=100)
    budget = output_budget("m", 8192, 10, req, 4096)
    assert (budget.max_tokens, budget.window, budget.requested) == (90, 100, 500)
