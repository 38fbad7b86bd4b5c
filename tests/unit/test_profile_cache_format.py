"""Stored auto-profiles across the format change that added the widest batched
prefill and the long-context point: the new fields come back whole, and an entry
stored before them is never trusted (it is measured again)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from omlx.engine.profile_cache import ENTRIES_PER_MODEL, FORMAT, ProfileCache, model_entries
from omlx.memory.budget import KVProfile
from omlx.settings import write_json_atomic

PROFILE = KVProfile(
    max_kv_tokens=5000,
    source="measured",
    baseline_bytes=100,
    seconds=1.5,
    batch_rows=2,
    batch_peak_bytes=300,
    batch_rows_widest=8,
    batch_widest_peak_bytes=1200,
    long_context_tokens=2048,
    long_context_peak_bytes=700,
    long_context_estimate_bytes=400,
    batch_row_bytes=150,
    unbatched_overhead_bytes=200,
)
NEW_FIELDS = (
    "batch_rows_widest",
    "batch_widest_peak_bytes",
    "long_context_tokens",
    "long_context_peak_bytes",
    "long_context_estimate_bytes",
    "batch_row_bytes",
    "unbatched_overhead_bytes",
)


def _measure_counting(calls: list[int]) -> Callable[[], KVProfile]:
    def measure() -> KVProfile:
        calls.append(1)
        return PROFILE

    return measure


def test_the_stress_fields_round_trip_through_the_stored_file(tmp_path: Path) -> None:
    cache, model, calls = ProfileCache(tmp_path / "profiles"), tmp_path / "m", []
    key = {"format": FORMAT, "inputs": {"chunk_tokens": 256}}
    assert cache.measure_or_reuse(key, model, _measure_counting(calls)) == (PROFILE, False)
    stored = json.loads(cache.path_for(model, key).read_text())["profile"]
    assert {name: stored[name] for name in NEW_FIELDS} == {
        name: getattr(PROFILE, name) for name in NEW_FIELDS
    }
    assert cache.measure_or_reuse(key, model, _measure_counting(calls)) == (PROFILE, True)
    assert len(calls) == 1


def test_a_profile_stored_before_the_stress_fields_is_measured_again(tmp_path: Path) -> None:
    cache, model, calls = ProfileCache(tmp_path / "profiles"), tmp_path / "m", []
    key = {"format": FORMAT, "inputs": {"chunk_tokens": 256}}
    old = dataclasses.asdict(PROFILE)
    for name in NEW_FIELDS:
        del old[name]
    # Under the older format's key (what an earlier omlx wrote), and under this one.
    for stored_key in ({**key, "format": 2}, key):
        write_json_atomic(cache.path_for(model, stored_key), {"key": stored_key, "profile": old})
        profile, reused = cache.measure_or_reuse(key, model, _measure_counting(calls))
        assert (profile, reused) == (PROFILE, False)
    assert len(calls) == 2 and cache.num_ignored == 1  # the second: malformed, not trusted


def test_switching_a_setting_back_reuses_its_measurement_and_old_entries_go(
    tmp_path: Path,
) -> None:
    """A user who turns kv_bits on and off again (or changes the concurrency, a limit)
    measures each setting once: every key keeps an entry of its own, the newest
    ENTRIES_PER_MODEL of a model are kept, and another model's entries are untouched."""
    folder, model, other, calls = tmp_path / "profiles", tmp_path / "m", tmp_path / "o", []
    cache = ProfileCache(folder)
    keys = [{"format": FORMAT, "inputs": {"batch_size": n}} for n in range(ENTRIES_PER_MODEL + 1)]
    cache.measure_or_reuse(keys[0], other, _measure_counting(calls))
    for key in keys[:2] * 2:  # on, off, on, off
        cache.measure_or_reuse(key, model, _measure_counting(calls))
    assert len(calls) == 3 and cache.num_reused == 2
    for key in keys[2:]:
        cache.measure_or_reuse(key, model, _measure_counting(calls))
    assert len(model_entries(folder, model)) == ENTRIES_PER_MODEL
    assert not cache.path_for(model, keys[0]).exists()  # the oldest went
    assert cache.path_for(model, keys[1]).exists() and cache.path_for(other, keys[0]).exists()
