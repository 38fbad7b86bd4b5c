"""The auto-profile's validation and teardown on a real tiny model and the real probe
(seed 002): the chosen capacity's KV is really allocated beside the steps, a
validation that peaks over the limit shrinks the capacity, memory must come back
after the passes."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from omlx.engine.profile import auto_profile
from omlx.errors import InsufficientMemoryError
from omlx.memory import mlx_stats
from omlx.memory.budget import (
    Limits,
    MemoryReading,
    apply_measured_margin,
    canary_bytes,
    guard_dims,
    kv_capacity_tokens,
)
from omlx.memory.probe import MemoryProbe
from omlx.models.discovery import discover_models
from omlx.models.loader import LoadedModel, load_model

MB = 1024**2
CHUNK = 256


@pytest.fixture(scope="module")
def llama(tiny_models_dir: Path) -> LoadedModel:
    return load_model(discover_models([tiny_models_dir])["tiny-llama"])


@pytest.fixture(scope="module")
def slow_llama(tiny_models_dir: Path) -> LoadedModel:
    """Head size 64: fused attention, so its capacity is bound by the KV itself."""
    return load_model(discover_models([tiny_models_dir])["slow-llama"])


def real_kv_bytes_per_token(model: Any) -> int:
    """What one token's K and V take in the model's own cache, all layers."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2]]), cache=cache))
    return sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in cache)


class RecordingProbe(MemoryProbe):
    """The real probe; records what each watched pass added to MLX's active bytes
    at its peak, and can add a real allocation by another tenant to chosen passes
    (numbered from 1), held until the pass ends."""

    def __init__(self, tenant: dict[int, int] | None = None) -> None:
        super().__init__()
        self.tenant = tenant or {}
        self.deltas: list[int] = []
        self._start = 0
        self._held: mx.array | None = None

    def watch_peak(self) -> MemoryReading:
        start = super().watch_peak()
        self._start = start.mlx_active_bytes
        if size := self.tenant.get(len(self.deltas) + 1):
            self._held = mx.full((size // 4,), 1, dtype=mx.float32)
            mx.eval(self._held)
        return start

    def watched_peak(self) -> tuple[int, MemoryReading]:
        peak, reading = super().watched_peak()
        self.deltas.append(peak - self._start)
        self._held = None
        return peak, reading


def _settled_resident() -> int:
    """What this process holds once the memory earlier tests freed is handed back
    (the profile hands it back at its teardown: it must not pass for a change)."""
    mlx_stats.release_cache()
    return MemoryProbe().reading(fresh=True).resident_bytes


def _limits(headroom: int) -> Limits:
    """An "auto"-margin ceiling ``headroom`` bytes above what this process holds now."""
    resident = _settled_resident()
    hard = resident + headroom
    return Limits(hard, int(hard * 0.85), 1024**3, margin_pinned=False)


def _profile(
    loaded: LoadedModel, probe: MemoryProbe, limits: Limits, model: Any = None, **kwargs: Any
) -> Any:
    """The load-time profile of ``loaded`` (or ``model`` in its place), one row per batch."""
    dims = kwargs.pop("dims", None) or guard_dims(
        loaded.config, kv_dtype_bytes=loaded.activation_bytes(), model=loaded.info.name
    )
    args = {"chunk_tokens": CHUNK, "batch_size": 1, "vocab_size": loaded.vocab_size}
    return auto_profile(model or loaded.model, dims, probe, limits, **{**args, **kwargs})


def _capacity(loaded: LoadedModel, limits: Limits, profile: Any, attempt: int) -> int:
    dims = guard_dims(loaded.config, kv_dtype_bytes=loaded.activation_bytes(), model="m")
    model_limits, extra = apply_measured_margin(
        limits, step_transient_bytes=profile.overhead_bytes, unmodeled_bytes=profile.unmodeled_bytes
    )
    return kv_capacity_tokens(
        model_limits,
        dims,
        baseline_bytes=profile.baseline_bytes,
        chunk_tokens=CHUNK,
        overhead_bytes=profile.overhead_bytes,
        unmodeled_bytes=extra,
        canary_bytes=canary_bytes(limits),
        attempt=attempt,
    )


def test_validation_holds_the_chosen_capacitys_kv_beside_the_steps(llama: LoadedModel) -> None:
    limits = _limits(160 * MB)
    probe = RecordingProbe()
    # The pool passes max_concurrent_requests x context window; here: the whole capacity.
    profile = _profile(llama, probe, limits, max_tokens_in_flight=10**8)
    per_token = real_kv_bytes_per_token(llama.model)
    assert profile.attempts == 1 and profile.max_kv_tokens > 10 * CHUNK
    # Every token of the chosen capacity, in the model's own K/V shapes and dtype.
    assert profile.held_kv_bytes == per_token * profile.max_kv_tokens
    # Really committed: MLX held it (and the canary) at the validation's peak.
    assert probe.deltas[-1] >= profile.held_kv_bytes + canary_bytes(limits)
    assert probe.deltas[0] < profile.held_kv_bytes  # the measurement held none


def test_a_validation_over_the_limit_shrinks_and_holds_the_smaller_kv(
    llama: LoadedModel,
) -> None:
    limits = _limits(160 * MB)
    # Another tenant takes the headroom while the first validation runs (passes 1 to 3
    # measure the solo chunk, the decode step and a chunk over a long context; one
    # row: no batched pass).
    probe = RecordingProbe(tenant={4: 160 * MB})
    profile = _profile(llama, probe, limits, max_tokens_in_flight=10**8)
    assert profile.long_context_tokens > 0
    assert profile.attempts == 2 and len(probe.deltas) == 5
    assert profile.max_kv_tokens == _capacity(llama, limits, profile, attempt=1)
    per_token = real_kv_bytes_per_token(llama.model)
    assert profile.held_kv_bytes == per_token * profile.max_kv_tokens
    assert probe.deltas[4] >= profile.held_kv_bytes
    # 5% less KV than the first attempt held (beside the tenant).
    assert probe.deltas[3] - 160 * MB >= profile.held_kv_bytes / 0.95 - per_token * 20


def test_kv_larger_than_the_arithmetic_fails_every_validation(
    slow_llama: LoadedModel,
) -> None:
    limits = _limits(160 * MB)
    probe = RecordingProbe()
    # Dims that think the float32 KV takes 1 byte per value: its real KV is 4x.
    wrong = guard_dims(slow_llama.config, kv_dtype_bytes=1, model="slow-llama")
    with pytest.raises(InsufficientMemoryError, match="validation passes") as info:
        _profile(slow_llama, probe, limits, dims=wrong, max_tokens_in_flight=10**8)
    assert "max_kv_tokens" in str(info.value)
    validations = probe.deltas[3:]  # after the solo, decode and long-context passes
    assert len(validations) == 4  # 1 try + 3 retries, each 5% smaller
    assert all(a > b for a, b in itertools.pairwise(validations))


class LeakyModel:
    """The real model, plus a buffer it keeps from every forward (a leak)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.layers = model.layers
        self.kept: list[mx.array] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.kept.append(mx.full((8 * MB,), 1, dtype=mx.float32))
        mx.eval(self.kept[-1])
        return self._model(*args, **kwargs)


def test_memory_not_back_after_the_passes_is_reported_and_counted(
    llama: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    leaky = LeakyModel(llama.model)
    before = _settled_resident()
    with caplog.at_level(logging.WARNING, logger="omlx.engine.profile"):
        profile = _profile(llama, MemoryProbe(), _limits(600 * MB), model=leaky)
    leaked = sum(a.nbytes for a in leaky.kept)
    assert leaked >= 4 * 32 * MB
    lines = [r.getMessage() for r in caplog.records if "did not come back" in r.getMessage()]
    assert lines and lines[0].startswith("memprofile:")
    assert profile.teardown_bytes >= before + leaked - 32 * MB
    assert profile.baseline_bytes == profile.teardown_bytes


def test_a_clean_teardown_keeps_the_baseline(
    llama: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="omlx.engine.profile"):
        profile = _profile(llama, MemoryProbe(), _limits(600 * MB), max_tokens_in_flight=10**5)
    assert not [r for r in caplog.records if "did not come back" in r.getMessage()]
    assert profile.teardown_bytes == profile.baseline_bytes
