"""Prompt-lookup drafting: what the drafter proposes from a request's history."""

from __future__ import annotations

import pytest

from omlx.engine.ngram import NgramDrafter


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    # "1 2 3" occurred twice before (both after a different token than now); the
    # later one was followed by 7 8.
    drafter = NgramDrafter([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3])
    assert drafter.propose(2) == [7, 8]
    assert drafter.propose(5) == [7, 8, 6, 1, 2]


def test_longest_match_wins_over_a_later_shorter_one() -> None:
    # The last two tokens "2 3" occur after "1" (then 4) and later after "9" (then
    # 5): the three-token match "1 2 3" decides.
    drafter = NgramDrafter([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    assert drafter.propose(1) == [4]


def test_a_weak_match_proposes_less_then_nothing() -> None:
    drafter = NgramDrafter([5, 6, 7, 8, 6])  # only "6" occurred before: one token
    assert drafter.propose(3) == [7]
    drafter = NgramDrafter([5, 6, 7, 8, 9, 5, 6])  # "5 6" matched: two tokens
    assert drafter.propose(4) == [7, 8]
    drafter = NgramDrafter([5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9, 4, 5, 6])  # long match
    assert drafter.propose(4) == [7, 8, 9, 4]
    assert NgramDrafter([1, 2, 3]).propose(3) == []
    assert NgramDrafter([]).propose(3) == []
    assert NgramDrafter([1, 2, 1]).propose(0) == []


def test_the_history_suffix_itself_is_never_its_own_match() -> None:
    drafter = NgramDrafter([4, 4])
    assert drafter.propose(3) == [4]  # the first 4 was followed by a 4


def test_tokens_appended_later_are_found() -> None:
    drafter = NgramDrafter([10, 11, 12, 13])
    assert drafter.propose(2) == []
    drafter.extend([20, 10, 11])
    assert drafter.propose(2) == [12, 13]
    drafter.append(99)
    assert drafter.propose(2) == []
    drafter.extend([10, 11, 12])
    assert drafter.propose(2) == [13, 20]  # 10 11 12 only occurred at the start


def test_min_match_leaves_out_single_token_matches() -> None:
    assert NgramDrafter([5, 6, 7, 8, 6], min_match=2).propose(3) == []
    with pytest.raises(ValueError):
        NgramDrafter([], min_match=0)


def test_the_place_being_copied_wins_over_a_later_repeat_of_a_short_piece() -> None:
    # A file with "x = 1" twice, then its copy under way: after "a : x =" the
    # drafter copies from the "a :" line, not from the later "b :" one.
    file = [50, 51, 10, 11, 1, 52, 53, 10, 11, 2]  # a : x = 1 / b : x = 2
    drafter = NgramDrafter([*file, 99, 50, 51, 10, 11])
    assert drafter.propose(3) == [1, 52, 53]


def test_long_histories_find_the_latest_occurrence() -> None:
    drafter = NgramDrafter(list(range(5_000)) * 2)
    drafter.extend([7, 8, 9])
    assert drafter.propose(3) == [10, 11, 12]
    drafter.extend([10, 11, 42, 43, 7, 8, 9, 10, 11])
    assert drafter.propose(2) == [42, 43]  # the latest "9 10 11" was followed by 42
