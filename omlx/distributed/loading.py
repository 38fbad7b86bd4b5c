"""Each rank loads only its shard of the model: tensor parallel through the model
class's own ``shard`` (mlx-lm), pipeline parallel through its ``model.pipeline``
(mlx-lm's PipelineMixin; for llama, omlx's llama_pipeline.py). As mlx-lm's
``sharded_load``, minus the Hub downloads (the model is a local folder on every
host) and its need for a safetensors index."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from omlx.distributed import llama_pipeline
from omlx.distributed.group import Membership
from omlx.errors import ModelLoadError
from omlx.models.discovery import ModelInfo
from omlx.models.loader import LoadedModel, load_model
from omlx.models.remote_code import library_refusal

log = logging.getLogger(__name__)

MODES = ("auto", "tensor", "pipeline")


def load_shard(info: ModelInfo, member: Membership, mode: str) -> LoadedModel:
    """This rank's shard of ``info`` as a LoadedModel (text models only)."""
    if info.kind != "llm":
        raise ModelLoadError(
            f"model '{info.name}' is a {info.kind} model; distributed serving runs text "
            "(LLM) models only"
        )
    return load_model(info, load_llm=partial(_load_llm_shard, member=member, mode=mode))


def _load_llm_shard(info: ModelInfo, *, member: Membership, mode: str) -> tuple[Any, Any, dict]:
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import load_tokenizer

    try:
        model, config = mlx_lm_load_model(
            info.path, lazy=True, strict=False, trust_remote_code=info.trust_remote_code
        )
    except (ValueError, OSError, KeyError) as exc:
        raise library_refusal(info.name, exc) or ModelLoadError(
            f"cannot load '{info.name}' from {info.path}: {exc}"
        ) from exc
    chosen = choose_mode(model, config, member.size, mode, info.name)
    if chosen == "tensor":
        model.shard(member.group)
    else:
        if hasattr(model.model, "pipeline"):
            model.model.pipeline(member.group)
        else:
            llama_pipeline.pipeline(model, member.group)
        for module in (model, model.model):
            _evaluate_inputs_first(module)
    mx.eval(model.parameters())  # only this rank's weights are read
    tokenizer = load_tokenizer(
        info.path,
        {"trust_remote_code": info.trust_remote_code},
        eos_token_ids=config.get("eos_token_id"),
    )
    # Every rank has its shard before any forward (mlx-lm's sharded_load does the same).
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=member.group, stream=mx.cpu))
    log.info(
        "distributed: rank %d of %d loaded its %s-parallel shard of %s",
        member.rank,
        member.size,
        chosen,
        info.name,
    )
    return model, tokenizer, {**config, "omlx_parallel": chosen}


def _evaluate_inputs_first(module: Any) -> None:
    """Each forward of a pipeline stage starts from evaluated inputs. mlx-lm's
    ``recv_like`` takes only a shape from its input, so a step queued on the lazy
    previous token (the decode's overlap) could run its receive before the previous
    step's all_gather on one rank and not the other: both would wait forever."""
    import mlx.core as mx

    base = type(module)

    def call(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        mx.eval(inputs)
        return base.__call__(self, inputs, *args, **kwargs)

    # A subclass in the same module: checks by the model's module still hold.
    module.__class__ = type(
        base.__name__, (base,), {"__call__": call, "__module__": base.__module__}
    )


def choose_mode(model: Any, config: dict, num_ranks: int, wanted: str, name: str) -> str:
    """ "tensor" or "pipeline" for this model and group size, or ModelLoadError saying
    why neither works."""
    tensor_why = _tensor_refusal(model, config, num_ranks)
    pipeline_why = _pipeline_refusal(model, config, num_ranks)
    if wanted in ("auto", "tensor") and tensor_why is None:
        return "tensor"
    if wanted in ("auto", "pipeline") and pipeline_why is None:
        return "pipeline"
    reasons = {"tensor": tensor_why, "pipeline": pipeline_why}
    tried = ["tensor", "pipeline"] if wanted == "auto" else [wanted]
    detail = "; ".join(f"{m} parallel: {reasons[m]}" for m in tried)
    raise ModelLoadError(f"cannot split model '{name}' across {num_ranks} ranks: {detail}")


def _tensor_refusal(model: Any, config: dict, num_ranks: int) -> str | None:
    if not hasattr(model, "shard"):
        return "its mlx-lm model class has no `shard`"
    text = config.get("text_config") or config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = text.get(key)
        if isinstance(heads, int) and heads % num_ranks:
            return f"{key} = {heads} is not a multiple of the {num_ranks} ranks"
    return None


def _pipeline_refusal(model: Any, config: dict, num_ranks: int) -> str | None:
    inner = getattr(model, "model", None)
    if inner is None:
        return "its mlx-lm model class has no `pipeline`"
    if not hasattr(inner, "pipeline") and (why := llama_pipeline.refusal(model)) is not None:
        return why
    if len(inner.layers) < num_ranks:
        return f"it has {len(inner.layers)} layers, fewer than the {num_ranks} ranks"
    return None
