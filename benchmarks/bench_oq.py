"""oQ against uniform quantization at equal bits per weight, on SmolLM2.

    .venv/bin/python benchmarks/bench_oq.py [--model DIR] [--levels oQ3 oQ4] [--group-size 64]

Measures every layer's sensitivity once on the shipped calibration text, then for
each level compares perplexity on the shipped held-out text of:
  - oQ: the planner's bits per layer;
  - uniform: what ``mlx_lm.convert -q --q-bits B`` does (every Linear / Embedding
    at B bits), through mlx-lm's own ``quantize_model``.
Both are evaluated as float matmuls on their dequantized weights (quantized matmul
is ~20x slower on the CPU backend; the values are identical). Bits per weight are
stored bits over the quantized layers, scales and biases included (the imported
SmolLM2 is float32, so each group of 64 costs 64 extra bits). Reports; never fails.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from omlx.quant.levels import bits_cost, get_level
from omlx.quant.planner import plan_bits
from omlx.quant.quality import (
    calibration_batches,
    fake_quantized,
    perplexity,
    shipped_text,
    token_chunks,
)
from omlx.quant.sensitivity import measure_sensitivity, quantizable_layers

DEFAULT_MODEL = Path("~/.omlx/models/SmolLM2-135M-Instruct").expanduser()


def uniform_perplexity(model, config, bits: int, group_size: int, chunks) -> float:
    from mlx_lm.utils import dequantize_model, quantize_model

    clone = copy.deepcopy(model)
    quantize_model(clone, config, group_size, bits)
    dequantize_model(clone)
    return perplexity(clone, chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--levels", nargs="+", default=["oQ3", "oQ4"])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--calibration-tokens", type=int, default=1024)
    parser.add_argument("--eval-tokens", type=int, default=1024)
    args = parser.parse_args()

    from mlx_lm import load

    model, tokenizer, config = load(str(args.model), return_config=True)
    calib_ids = tokenizer.encode(shipped_text("calibration"))
    calib = calibration_batches(calib_ids, 512, args.calibration_tokens)
    held = token_chunks(tokenizer.encode(shipped_text("heldout")), 512, args.eval_tokens)
    layers = quantizable_layers(model, args.group_size)
    scale_bits = next(iter(layers.values())).weight.dtype.size * 8
    all_bits = sorted({b for name in args.levels for b in get_level(name).candidate_bits})
    start = time.perf_counter()
    stats = measure_sensitivity(model, calib, all_bits, args.group_size)
    print(f"measured {len(stats)} layers at bits {all_bits} in {time.perf_counter() - start:.1f} s")
    print(f"calibration {sum(c.size for c in calib)} tokens, held-out {sum(c.size for c in held)}")
    print(f"float perplexity: {perplexity(model, held):.3f}")
    num_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"parameters: {num_params:,}; quantized layers hold {sum(s.num_params for s in stats):,}")
    print()
    print("| variant | bits/weight | perplexity | layers per width |")
    print("|---|---|---|---|")
    for name in args.levels:
        level = get_level(name)
        plan = plan_bits(stats, level, args.group_size, scale_bits)
        with fake_quantized(model, plan.bits, args.group_size):
            ppl = perplexity(model, held)
        print(f"| {name} | {plan.bits_per_weight:.3f} | {ppl:.3f} | {plan.histogram()} |")
        uniform = uniform_perplexity(model, config, level.base_bits, args.group_size, held)
        cost = bits_cost(level.base_bits, args.group_size, scale_bits)
        bits = level.base_bits
        print(f"| uniform {bits}-bit | {cost:.3f} | {uniform:.3f} | all {bits} |")
    mx.clear_cache()


if __name__ == "__main__":
    main()
