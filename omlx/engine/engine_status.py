"""What a loaded engine reports in the model list (admin API, /health, /metrics)."""

from __future__ import annotations

import dataclasses
from typing import Any

from omlx.embeddings.engine import EmbeddingEngine
from omlx.engine.model_engine import ModelEngine


def engine_status(engine: ModelEngine | EmbeddingEngine | None) -> dict[str, Any]:
    """Requests in flight and queued, the auto-profile, what the memory guard did,
    and each kind's own counters; zeros and None for a model not loaded."""
    if engine is None:
        return {
            "requests_in_flight": 0,
            "requests_queued": 0,
            "kv_profile": None,
            "num_deferrals": 0,
            "num_gated": 0,
            "memory_guard": None,
            "batching": None,
            "speculative": None,
            "kv_bits": None,
            "quantized_kv_start": None,
        }
    return {
        "requests_in_flight": engine.num_in_flight,
        "requests_queued": engine.num_queued,
        "kv_profile": _kv_profile(engine),
        # Requests memory admission kept queued / the forward gate ended.
        "num_deferrals": engine.num_deferrals,
        "num_gated": engine.num_gated,
        "memory_guard": engine.guard_counters(),
        "batching": _batching(engine),
        "speculative": _speculative(engine),
        "kv_bits": kv_bits(engine),
        "quantized_kv_start": quantized_kv_start(engine),
    }


def kv_dims(engine: ModelEngine | EmbeddingEngine) -> dict[str, int] | None:
    """What the memory guard prices a sequence at: its KV per token and its fixed
    states (a hybrid's recurrent / convolution layers; 0 for attention only). None
    for an embedding model (no KV)."""
    if not isinstance(engine, ModelEngine):
        return None
    dims = engine.guard.dims
    return {
        "kv_bytes_per_token": dims.kv_bytes_per_token,
        "state_bytes_per_sequence": dims.state_bytes_per_sequence,
    }


def kv_bits(engine: ModelEngine | EmbeddingEngine) -> int | None:
    """The bits of the engine's KV cache as loaded (None: full precision, or no KV)."""
    if isinstance(engine, ModelEngine) and engine.kv_quant is not None:
        return engine.kv_quant.bits
    return None


def quantized_kv_start(engine: ModelEngine | EmbeddingEngine) -> int | None:
    """The tokens a sequence's KV stays full precision for before it is quantized, as
    loaded (0: from the first; None: no quantized KV)."""
    if isinstance(engine, ModelEngine) and engine.kv_quant is not None:
        return engine.kv_quant.start
    return None


def _kv_profile(engine: ModelEngine | EmbeddingEngine) -> dict[str, Any] | None:
    """The load-time auto-profile and the KV capacity under the limits in force now."""
    guard = engine.guard
    if guard.profile is None:
        return None
    return {**dataclasses.asdict(guard.profile), "max_kv_tokens": guard.max_kv_tokens}


def _speculative(engine: ModelEngine | EmbeddingEngine) -> dict[str, Any] | None:
    """An LLM's speculative decoding: drafts per step now, and its counters."""
    if not isinstance(engine, ModelEngine):
        return None
    draft = engine.draft
    return {
        "num_tokens": engine.num_draft,
        # The draft model proposing tokens (None: prompt lookup), and its KV per token.
        "draft_model": draft.name if draft is not None else None,
        "draft_kv_bytes_per_token": draft.kv_bytes_per_token if draft is not None else 0,
        **engine.speculative_stats(),
    }


def _batching(engine: ModelEngine | EmbeddingEngine) -> dict[str, Any]:
    """An embedding model's batch counters; an LLM's batching: whether it serves one
    request at a time, and why (engine/unbatched.py)."""
    if isinstance(engine, EmbeddingEngine):
        return engine.batch_stats()
    return {"one_at_a_time": engine.unbatched is not None, "reason": engine.unbatched}
