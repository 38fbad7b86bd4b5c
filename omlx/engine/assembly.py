"""A loaded model made into a ModelEngine: its prefix cache, runner, scheduler and
memory guard, with the auto-profile (reused or measured) and the compiled steps
proven. MLX thread only (the pool calls it inside a load)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx

from omlx.cache.hot import HotTier
from omlx.cache.prefix import PrefixCache
from omlx.cache.setup import make_prefix_cache
from omlx.engine.admission import AdmissionSwitch
from omlx.engine.batching_verdict import BatchingVerdicts, batching_key
from omlx.engine.compiled_batch import CompiledSteps
from omlx.engine.gate_inputs import request_held_states, request_one_forward
from omlx.engine.kv_measure import cache_step, with_kv_start, with_measured_kv
from omlx.engine.model_engine import ModelEngine
from omlx.engine.output_probe import output_probe
from omlx.engine.profile_cache import ProfileCache, ProfileInputs, profile_model
from omlx.engine.profile_stress import stress_report
from omlx.engine.quantized_cache import install as install_quantized_kv
from omlx.engine.runner import BatchRunner
from omlx.engine.strategy import ExecutionStrategy
from omlx.engine.unbatched import batch_probe
from omlx.engine.worker import MLXWorker
from omlx.errors import SettingsError
from omlx.memory.budget import KVProfile, Limits, ModelDims, guard_dims
from omlx.memory.guard import MemoryGuard
from omlx.memory.probe import MemoryProbe
from omlx.models.loader import LoadedModel
from omlx.models.model_settings import KVQuantSpec
from omlx.scheduler import Scheduler
from omlx.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What the pool shares with every engine it builds."""

    settings: Settings
    worker: MLXWorker
    hot_cache: HotTier | None
    limits: Limits
    probe: MemoryProbe
    profile_cache: ProfileCache
    baseline: Callable[[], int]  # the live idle baseline
    admission: AdmissionSwitch  # the pool's one admission switch (the enforcer's)
    # omlx.distributed.cluster.Cluster when the model is split across ranks (rank 0).
    cluster: Any = None


def build_engine(
    loaded: LoadedModel,
    parts: EngineParts,
    *,
    window: int,
    explicit_kv_tokens: int | None,
    kv_quant: KVQuantSpec | None = None,
) -> tuple[ModelEngine, dict[str, Any]]:
    """The engine, and how its load went (``kv_profile``: measured or reused,
    ``compiled_steps``) for /health. A load that fails leaves no prefix cache
    attached to the shared RAM tier (the next load of the model starts clean).
    ``kv_quant``: the model's KV cache is quantized (quantized_cache.py)."""
    cluster = parts.cluster
    shard = cluster.cache_shard() if cluster is not None else ""
    if kv_quant is not None:
        _quantize_kv(loaded, kv_quant, cluster)
    # After _quantize_kv: its layers (the model's make_cache) are the cache's layout.
    prefix = make_prefix_cache(parts.settings, parts.hot_cache, loaded, shard)
    try:
        engine, facts = _assemble(loaded, parts, prefix, window, explicit_kv_tokens, kv_quant)
        engine.kv_quant = kv_quant
        return engine, facts
    except BaseException:
        if prefix is not None:
            prefix.close()
        raise


def _quantize_kv(loaded: LoadedModel, spec: KVQuantSpec, cluster: Any) -> None:
    """Every cache of the model quantized from here on; the compiled steps eager
    (they trace plain KV)."""
    name = loaded.info.name
    if cluster is not None:
        raise SettingsError(
            f"kv_bits: a model split across ranks keeps full-precision KV; clear {name}'s kv_bits",
            param="kv_bits",
        )
    install_quantized_kv(loaded.model, spec, name)
    log.info(
        "%s for %s: compiled decode steps off, no speculative decoding",
        spec.describe(),
        name,
    )


def _assemble(
    loaded: LoadedModel,
    parts: EngineParts,
    prefix: PrefixCache | None,
    window: int,
    explicit_kv_tokens: int | None,
    kv_quant: KVQuantSpec | None = None,
) -> tuple[ModelEngine, dict[str, Any]]:
    sched = parts.settings.scheduler
    cluster = parts.cluster
    strategy = ExecutionStrategy.choose(sched.execution_strategy, mx.default_device().type.name)
    if cluster is not None:
        strategy = strategy.split()
    runner = BatchRunner(
        loaded.model,
        prefill_step_size=sched.prefill_step_size,
        stream=parts.worker.stream,
        prefix_cache=prefix,
        strategy=strategy,
        vision=loaded.vision,
        shared_hits=cluster.shared_hits() if cluster is not None else None,
        compiled=CompiledSteps() if kv_quant is not None else None,
    )
    scheduler = Scheduler(
        sched.max_concurrent_requests,
        sched.max_queued_requests,
        gather_s=sched.burst_window_ms / 1000,
        gather_max_s=sched.burst_max_ms / 1000,
        prefill_step_size=sched.prefill_step_size,
        share_openings=runner.shares_openings,
        name=loaded.info.name,
        kv_step=cache_step(loaded.model),
        held_states=partial(request_held_states, loaded.vision),
        one_forward=partial(request_one_forward, loaded.vision),
    )
    unbatched = (
        _probe_batching(loaded, parts, scheduler, strategy, kv_quant) if cluster is None else None
    )
    dims = guard_dims(
        loaded.config, kv_dtype_bytes=loaded.activation_bytes(), model=loaded.info.name
    )
    if cluster is not None:
        dims = cluster.rank_dims(dims)  # each rank holds its share of heads or layers
    else:
        dims = with_measured_kv(dims, loaded.model, loaded.info.name)
        if kv_quant is not None:
            dims = with_kv_start(
                dims,
                loaded.model,
                kv_quant.start,
                rows=scheduler.max_running,
                chunk_tokens=sched.prefill_step_size,
            )
    guard = MemoryGuard(
        loaded.info.name,
        dims,
        limits=parts.limits,
        baseline=parts.baseline,
        chunk_tokens=sched.prefill_step_size,
        kv_step=scheduler.kv_step,
    )
    stress: dict[str, Any] | None = None
    if cluster is None:
        profile, reused = _profile(
            loaded, parts, dims, window, explicit_kv_tokens, scheduler.max_running
        )
        guard.set_profile(profile)
        kv_profile = "reused" if reused else "measured"
        stress = stress_report(profile)
    else:
        # The profile's forwards would run on rank 0 alone; the guard works from readings.
        kv_profile = cluster.skip_profile(guard, explicit_kv_tokens)
    # After the profile, so its readings are what they were without the checks.
    runner.prove_compiled()
    facts = {
        "kv_profile": kv_profile,
        # What the profile's stress measured and what it extrapolated (None: no profile).
        "profile_stress": stress,
        "compiled_steps": _proofs(runner),
        "execution_strategy": strategy.describe(),
    }
    engine = (ModelEngine if cluster is None else cluster.engine_class)(
        loaded,
        runner if cluster is None else cluster.runner(runner),
        scheduler,
        parts.worker,
        context_window=window,
        guard=guard,
        probe=parts.probe if cluster is None else cluster.probe(parts.probe, parts.limits),
        prefix_cache=prefix,
        admission=parts.admission,
    )
    engine.unbatched = unbatched
    return engine, facts


def _probe_batching(
    loaded: LoadedModel,
    parts: EngineParts,
    scheduler: Scheduler,
    strategy: ExecutionStrategy,
    kv_quant: KVQuantSpec | None,
) -> str | None:
    """A model that cannot batch, or whose batch gives other tokens than each
    request alone, runs one request at a time from the start (unbatched.py,
    output_probe.py; the verdict kept between starts, batching_verdict.py): the
    reason, or None."""
    if scheduler.max_running < 2:
        return None
    family = loaded.vision.family if loaded.vision is not None else None
    reason = family.one_at_a_time if family is not None else None
    if reason is None:
        new_runner = partial(_probe_runner, loaded, parts, strategy)
        runner_facts = {
            "activation_bytes": loaded.activation_bytes(),
            "kv_quant": kv_quant.describe() if kv_quant is not None else None,
            "prefill_step_size": parts.settings.scheduler.prefill_step_size,
            "strategy": strategy.name,
        }
        reason, _ = BatchingVerdicts(parts.profile_cache.folder / "batching").probe_or_reuse(
            batching_key(loaded.info, runner_facts),
            loaded.info.path,
            lambda: (
                batch_probe(loaded.model, loaded.vocab_size)
                or output_probe(new_runner, loaded.vocab_size, loaded.activation_bytes())
            ),
        )
    if reason is not None:
        scheduler.max_running = 1
        log.warning(
            "model %s cannot batch: %s; serving its requests one at a time",
            loaded.info.name,
            reason,
        )
    return reason


def _probe_runner(
    loaded: LoadedModel, parts: EngineParts, strategy: ExecutionStrategy
) -> BatchRunner:
    """A runner like the engine's for the output probe: no prefix cache, eager."""
    return BatchRunner(
        loaded.model,
        prefill_step_size=parts.settings.scheduler.prefill_step_size,
        stream=parts.worker.stream,
        strategy=dataclasses.replace(strategy, compiled=False),
        vision=loaded.vision,
    )


def _profile(
    loaded: LoadedModel,
    parts: EngineParts,
    dims: ModelDims,
    window: int,
    explicit_kv_tokens: int | None,
    batch_size: int,
) -> tuple[KVProfile, bool]:
    """The auto-profile: reused from an earlier start when nothing it depends on
    changed (profile_cache.py), else measured now and kept."""
    sched = parts.settings.scheduler
    inputs = ProfileInputs(
        chunk_tokens=sched.prefill_step_size,
        batch_size=batch_size,
        vocab_size=loaded.vocab_size,
        explicit_tokens=explicit_kv_tokens,
        # Validation holds the KV that can really be in flight at once.
        max_tokens_in_flight=window * batch_size,
        context_window=window,
    )
    return profile_model(
        parts.profile_cache, loaded.info, loaded.model, dims, parts.probe, parts.limits, inputs,
        vision=loaded.vision,
    )  # fmt: skip


def _proofs(runner: BatchRunner) -> dict[str, str]:
    """Each compiled step's one-time proof, as the load left it (a proven step never
    runs its proof again; "eager": the model does not qualify)."""
    steps = {"decode": runner.compiled_decoder, "batch": runner.compiled_batch_step}
    return {
        what: "eager" if step is None else "proven" if step.proven else "failed"
        for what, step in steps.items()
    }
