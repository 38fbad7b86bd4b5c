"""The oQ job: load a float mlx-lm model, measure, plan, quantize, check, save.

The output is a plain mlx-lm folder: ``config.json`` with a ``quantization``
block naming every layer's bits and group size, safetensors weights, the
source's tokenizer files, and ``oq_report.json`` with the plan and numbers.
Everything is written into a hidden temp folder next to the destination and
renamed at the end; a cancel or failure removes it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from omlx.errors import ModelLoadError
from omlx.models.loader import mlx_lm_load
from omlx.models.remote_code import require_allowed
from omlx.quant.estimate import source_config
from omlx.quant.levels import check_group_size, get_level
from omlx.quant.names import check_free, temp_dir_for
from omlx.quant.planner import Plan, plan_bits
from omlx.quant.quality import calibration_batches, perplexity, shipped_text, token_chunks
from omlx.quant.sensitivity import QuantCancelled, measure_sensitivity, quantizable_layers

log = logging.getLogger(__name__)

# Share of the whole job each phase takes, for one overall fraction.
PHASE_SPANS = {
    "loading": (0.0, 0.05),
    "measuring": (0.05, 0.55),
    "quantizing": (0.55, 0.65),
    "evaluating": (0.65, 0.9),
    "saving": (0.9, 1.0),
}
# Files of the source that the output must not copy (it writes its own).
_OWN_FILES = {"config.json", "model.safetensors.index.json", "oq_report.json"}

Progress = Callable[[str, float], None]


@dataclass(frozen=True, slots=True)
class QuantOptions:
    level: str
    group_size: int = 64
    max_calibration_tokens: int = 1024
    max_eval_tokens: int = 1024
    chunk_tokens: int = 512
    # The model's setting: its folder's own Python code may run (its tokenizer's).
    trust_remote_code: bool = False


@dataclass(frozen=True, slots=True)
class QuantResult:
    output_path: str
    size_bytes: int
    bits_per_weight: float
    target_bits_per_weight: float
    perplexity_before: float
    perplexity_after: float
    num_layers: int
    bits_histogram: dict[str, int]
    elapsed_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Steps:
    """Progress and cancel plumbing shared by the phases."""

    def __init__(self, on_progress: Progress | None, should_stop: Callable[[], bool] | None):
        self._on_progress = on_progress or (lambda _p, _f: None)
        self.should_stop = should_stop or (lambda: False)

    def report(self, phase: str, fraction: float = 0.0) -> None:
        start, end = PHASE_SPANS[phase]
        self._on_progress(phase, start + (end - start) * min(1.0, max(0.0, fraction)))

    def within(self, phase: str, lo: float, hi: float) -> Callable[[float], None]:
        return lambda f: self.report(phase, lo + (hi - lo) * f)

    def check(self) -> None:
        if self.should_stop():
            raise QuantCancelled


def quantize_folder(
    source: Path,
    dest: Path,
    options: QuantOptions,
    on_progress: Progress | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> QuantResult:
    """Quantize the model folder ``source`` into the new folder ``dest``.

    Raises InvalidRequestError for a bad level / group size / already-quantized
    source, OutputExistsError when ``dest`` exists, ModelLoadError when the
    source cannot be loaded, QuantCancelled when ``should_stop`` said so.
    """
    started = time.perf_counter()
    level = get_level(options.level)
    check_group_size(options.group_size)
    check_free(dest)
    config = source_config(source)
    steps = _Steps(on_progress, should_stop)
    tmp = temp_dir_for(dest)
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed run
    try:
        steps.report("loading")
        model, tokenizer = _load(source, options.trust_remote_code)
        steps.check()
        plan, ppl_before = _measure_and_plan(model, tokenizer, level, options, steps)
        weights = _quantize(model, plan, steps)
        ppl_after = _evaluate(model, tokenizer, options, steps)
        size = _save(source, tmp, weights, config, plan, steps)
        check_free(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    steps.report("saving", 1.0)
    return QuantResult(
        output_path=str(dest),
        size_bytes=size,
        bits_per_weight=round(plan.bits_per_weight, 4),
        target_bits_per_weight=round(plan.target_bits_per_weight, 4),
        perplexity_before=round(ppl_before, 4),
        perplexity_after=round(ppl_after, 4),
        num_layers=len(plan.bits),
        bits_histogram=plan.histogram(),
        elapsed_s=round(time.perf_counter() - started, 2),
    )


def _load(source: Path, trust_remote_code: bool) -> tuple[nn.Module, Any]:
    require_allowed(source.name, source, trust_remote_code)
    try:
        model, tokenizer, _config = mlx_lm_load(source, trust_remote_code)
    except Exception as exc:  # mlx-lm raises ValueError, RuntimeError, OSError, KeyError...
        raise ModelLoadError(f"cannot load '{source.name}': {exc}") from exc
    return model, tokenizer


def _measure_and_plan(
    model: nn.Module, tokenizer: Any, level: Any, options: QuantOptions, steps: _Steps
) -> tuple[Plan, float]:
    tokens = tokenizer.encode(shipped_text("calibration"))
    chunks = calibration_batches(tokens, options.chunk_tokens, options.max_calibration_tokens)
    bits = level.candidate_bits
    stats = measure_sensitivity(
        model,
        chunks,
        bits,
        options.group_size,
        steps.within("measuring", 0.0, 0.85),
        steps.should_stop,
    )
    eval_chunks = _eval_chunks(tokenizer, options)
    ppl_before = perplexity(
        model, eval_chunks, steps.within("measuring", 0.85, 1.0), steps.should_stop
    )
    layers = quantizable_layers(model, options.group_size)
    scale_bits = max(m.weight.dtype.size for m in layers.values()) * 8
    plan = plan_bits(stats, level, options.group_size, scale_bits)
    log.info(
        "oQ plan: %s bits per weight (target %s), layers per width %s",
        f"{plan.bits_per_weight:.3f}",
        f"{plan.target_bits_per_weight:.3f}",
        plan.histogram(),
    )
    return plan, ppl_before


def _eval_chunks(tokenizer: Any, options: QuantOptions) -> list[mx.array]:
    tokens = tokenizer.encode(shipped_text("heldout"))
    return token_chunks(tokens, options.chunk_tokens, options.max_eval_tokens)


def quantize_with_plan(model: nn.Module, plan: Plan) -> None:
    """Swap each planned layer for its quantized form, in place."""

    def predicate(path: str, _module: nn.Module) -> bool | dict[str, Any]:
        bits = plan.bits.get(path)
        return False if bits is None else {"group_size": plan.group_size, "bits": bits}

    nn.quantize(model, plan.group_size, 4, class_predicate=predicate)


def _quantize(model: nn.Module, plan: Plan, steps: _Steps) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    steps.report("quantizing")
    quantize_with_plan(model, plan)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(list(weights.values()))
    steps.report("quantizing", 1.0)
    steps.check()
    return weights


def _evaluate(model: nn.Module, tokenizer: Any, options: QuantOptions, steps: _Steps) -> float:
    """Perplexity of the quantized weights, run as float matmuls on their exact
    dequantized values (quantized matmul is much slower on MLX's CPU backend:
    benchmarks/README.md, "Figures behind design choices")."""
    from mlx_lm.utils import dequantize_model

    steps.report("evaluating")
    dequantize_model(model)
    return perplexity(
        model,
        _eval_chunks(tokenizer, options),
        steps.within("evaluating", 0.0, 1.0),
        steps.should_stop,
    )


def quantization_config(plan: Plan) -> dict[str, Any]:
    """mlx-lm's per-layer form: defaults plus one {bits, group_size} entry per layer."""
    counts = plan.histogram()
    default_bits = int(max(counts, key=lambda b: counts[b]))
    block: dict[str, Any] = {"group_size": plan.group_size, "bits": default_bits, "mode": "affine"}
    for path, bits in sorted(plan.bits.items()):
        block[path] = {"group_size": plan.group_size, "bits": bits}
    return block


def _save(
    source: Path,
    tmp: Path,
    weights: dict[str, mx.array],
    config: dict[str, Any],
    plan: Plan,
    steps: _Steps,
) -> int:
    from mlx_lm.utils import make_shards

    steps.report("saving")
    tmp.mkdir(parents=True)
    shards = make_shards(weights)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for i, (name, shard) in enumerate(zip(names, shards, strict=True)):
        steps.check()
        mx.save_safetensors(str(tmp / name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, name))
        steps.report("saving", 0.9 * (i + 1) / len(shards))
    size = sum((tmp / name).stat().st_size for name in names)
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(tmp / "model.safetensors.index.json", index)
    quant = quantization_config(plan)
    # quantization_config too: the Hugging Face tree reads that key (mlx-lm writes both).
    config = {**config, "quantization": quant, "quantization_config": quant}
    _write_json(tmp / "config.json", config)
    _write_json(tmp / "oq_report.json", {"source": source.name, **asdict(plan)})
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in _OWN_FILES:
            shutil.copy2(item, tmp / item.name)
    return size


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
