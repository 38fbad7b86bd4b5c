"""The engine pool's residency policy: LRU eviction under a byte budget, idle expiry."""

from __future__ import annotations

from omlx.engine.residency import ResidentModel, choose_evictions, expired, next_expiry_s

GB = 1 << 30


def model(
    name: str,
    *,
    size_gb: int = 1,
    last_used_s: float = 0.0,
    pinned: bool = False,
    in_flight: int = 0,
    ttl_s: float | None = None,
) -> ResidentModel:
    return ResidentModel(name, size_gb * GB, pinned, in_flight, last_used_s, ttl_s)


# ---- choose_evictions ------------------------------------------------------------------


def test_nothing_evicted_when_it_already_fits():
    resident = [model("a", last_used_s=1)]

    assert (
        choose_evictions(resident, need_bytes=3 * GB, used_bytes=1 * GB, budget_bytes=4 * GB) == []
    )


def test_least_recently_used_goes_first_and_only_as_many_as_needed():
    resident = [
        model("newest", last_used_s=30),
        model("oldest", last_used_s=10),
        model("middle", last_used_s=20),
    ]

    one = choose_evictions(resident, need_bytes=1 * GB, used_bytes=3 * GB, budget_bytes=3 * GB)
    two = choose_evictions(resident, need_bytes=2 * GB, used_bytes=3 * GB, budget_bytes=3 * GB)

    assert one == ["oldest"]
    assert two == ["oldest", "middle"]


def test_exact_fit_after_eviction_is_enough():
    resident = [model("a", size_gb=2, last_used_s=1), model("b", size_gb=2, last_used_s=2)]

    # 4 used - 2 freed + 3 needed == 5 budget.
    assert choose_evictions(resident, 3 * GB, used_bytes=4 * GB, budget_bytes=5 * GB) == ["a"]


def test_pinned_and_busy_models_are_never_chosen():
    resident = [
        model("pinned", last_used_s=1, pinned=True),
        model("busy", last_used_s=2, in_flight=1),
        model("idle", last_used_s=3),
    ]

    chosen = choose_evictions(resident, need_bytes=1 * GB, used_bytes=3 * GB, budget_bytes=3 * GB)

    assert chosen == ["idle"]


def test_none_when_evicting_every_evictable_model_is_not_enough():
    resident = [
        model("pinned", size_gb=4, last_used_s=1, pinned=True),
        model("busy", size_gb=4, last_used_s=2, in_flight=2),
        model("idle", size_gb=1, last_used_s=3),
    ]

    # Freeing "idle" leaves 8 used + 2 needed > 9: nothing should be unloaded.
    assert choose_evictions(resident, 2 * GB, used_bytes=9 * GB, budget_bytes=9 * GB) is None


def test_none_when_the_model_alone_exceeds_the_budget():
    assert choose_evictions([], need_bytes=5 * GB, used_bytes=0, budget_bytes=4 * GB) is None


def test_ties_on_last_use_break_by_name_not_list_order():
    forwards = [model("b", last_used_s=5), model("a", last_used_s=5)]
    backwards = list(reversed(forwards))

    for resident in (forwards, backwards):
        assert choose_evictions(resident, 1 * GB, used_bytes=2 * GB, budget_bytes=2 * GB) == ["a"]


# ---- expired / next_expiry_s -------------------------------------------------------------


def test_global_idle_timeout_expires_idle_models():
    resident = [model("old", last_used_s=100), model("recent", last_used_s=150)]

    assert expired(resident, now_s=159.0, global_idle_timeout_s=60) == []
    assert expired(resident, now_s=160.0, global_idle_timeout_s=60) == ["old"]
    assert expired(resident, now_s=300.0, global_idle_timeout_s=60) == ["old", "recent"]


def test_no_global_timeout_means_never_without_a_model_ttl():
    resident = [model("a", last_used_s=0)]

    assert expired(resident, now_s=1e9, global_idle_timeout_s=None) == []
    assert next_expiry_s(resident, now_s=1e9, global_idle_timeout_s=None) is None


def test_model_ttl_overrides_the_global_timeout_both_ways():
    resident = [
        model("short", last_used_s=0, ttl_s=10),
        model("long", last_used_s=0, ttl_s=1000),
        model("inherits", last_used_s=0),
    ]

    assert expired(resident, now_s=10.0, global_idle_timeout_s=None) == ["short"]
    assert expired(resident, now_s=100.0, global_idle_timeout_s=100) == ["inherits", "short"]
    assert expired(resident, now_s=1000.0, global_idle_timeout_s=100) == [
        "inherits",
        "long",
        "short",
    ]


def test_pinned_and_busy_models_never_expire():
    resident = [
        model("pinned", last_used_s=0, pinned=True, ttl_s=1),
        model("busy", last_used_s=0, in_flight=1, ttl_s=1),
    ]

    assert expired(resident, now_s=1e9, global_idle_timeout_s=1) == []
    assert next_expiry_s(resident, now_s=1e9, global_idle_timeout_s=1) is None


def test_next_expiry_is_the_soonest_wait():
    resident = [model("a", last_used_s=100, ttl_s=50), model("b", last_used_s=120)]

    assert next_expiry_s(resident, now_s=130.0, global_idle_timeout_s=15) == 5.0
    assert next_expiry_s(resident, now_s=200.0, global_idle_timeout_s=15) == 0.0
