"""Pipeline parallel for mlx-lm's llama, whose class has ``shard`` but no ``pipeline``
(so the built-in SmolLM2, whose 9 heads no 2 ranks can share, still splits across 2).
The same split and forward as mlx-lm's PipelineMixin models (its qwen2.py): the last
rank runs the first layers, rank 0 the last, hidden states go down the ranks and the
result is gathered on every rank. Llama models with sliding-window layers are refused."""

from __future__ import annotations

from typing import Any

LLAMA_MODULE = "mlx_lm.models.llama"


def refusal(model: Any) -> str | None:
    """Why the adapter cannot split ``model`` (None: it can)."""
    if type(model).__module__ != LLAMA_MODULE:
        return "its mlx-lm model class has no `pipeline`"
    if getattr(model.model, "swa_idx", None) is not None:
        return "its sliding-window layers are not split by omlx's llama pipeline"
    return None


def pipeline(model: Any, group: Any) -> None:
    """Keep this rank's layers of ``model`` (a llama) and give it the pipelined forward."""
    from mlx_lm.models.pipeline import PipelineMixin

    inner = model.model
    PipelineMixin.pipeline(inner, group)  # the same split as mlx-lm's own models
    inner.__class__ = _subclass(
        type(inner), {"__call__": _forward, "pipeline_layers": PipelineMixin.pipeline_layers}
    )
    # The caches (make_cache walks ``layers``) are for this rank's layers only.
    model.__class__ = _subclass(type(model), {"layers": property(_own_layers)})


def _own_layers(model: Any) -> list[Any]:
    return list(model.model.pipeline_layers)


def _subclass(base: type, members: dict[str, Any]) -> type:
    # Same module: checks by the model's module (solo.output_head) still hold.
    return type(base.__name__, (base,), {**members, "__module__": base.__module__})


def _forward(self: Any, inputs: Any, cache: Any = None, input_embeddings: Any = None) -> Any:
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
    rank, size, layers = self.pipeline_rank, self.pipeline_size, self.pipeline_layers
    if cache is None:
        cache = [None] * len(layers)
    mask = create_attention_mask(h, cache[0])
    if rank < size - 1:  # from the rank that ran the layers before ours
        h = mx.distributed.recv_like(h, rank + 1)
    for layer, layer_cache in zip(layers, cache, strict=True):
        h = layer(h, mask, cache=layer_cache)
    if rank != 0:
        h = mx.distributed.send(h, rank - 1)
        if cache[-1] is not None:  # the send runs whenever the cache is evaluated
            cache[-1].keys = mx.depends(cache[-1].keys, h)
    if size > 1:
        h = mx.distributed.all_gather(h)[: h.shape[0]]
    return self.norm(h)
