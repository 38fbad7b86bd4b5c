"""GGUF import speed on a K-quant file of realistic tensor shapes.

    .venv/bin/python benchmarks/bench_gguf_import.py [--layers 8] [--dtypes float32 keep]

Writes a Q4_K_M-mix GGUF (Q4_K, Q6_K for attn_v / ffn_down / output, F32 norms)
with TinyLlama-1.1B's shapes (hidden 2048, FFN 5632, 32 heads, 4 KV heads,
vocab 32000) and ``--layers`` layers (8: ~290 MB), then times
``convert_gguf`` for each dtype: MB of GGUF per second, the whole import
(header, decode or repack, tokenizer, safetensors written). Reports; never fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from omlx.models.gguf import convert_gguf
from tests.fixtures.gguf_files import quantize

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000
HEAD_DIM = HIDDEN // HEADS


def tensor_shapes(layers: int) -> dict[str, tuple[tuple[int, ...], Q]]:
    shapes = {
        "token_embd.weight": ((VOCAB, HIDDEN), Q.Q4_K),
        "output_norm.weight": ((HIDDEN,), Q.F32),
        "output.weight": ((VOCAB, HIDDEN), Q.Q6_K),
    }
    for i in range(layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_q.weight": ((HIDDEN, HIDDEN), Q.Q4_K),
            p + "attn_k.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_K),
            p + "attn_v.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q6_K),
            p + "attn_output.weight": ((HIDDEN, HIDDEN), Q.Q4_K),
            p + "ffn_gate.weight": ((FFN, HIDDEN), Q.Q4_K),
            p + "ffn_up.weight": ((FFN, HIDDEN), Q.Q4_K),
            p + "ffn_down.weight": ((HIDDEN, FFN), Q.Q6_K),
            p + "attn_norm.weight": ((HIDDEN,), Q.F32),
            p + "ffn_norm.weight": ((HIDDEN,), Q.F32),
        }
    return shapes


def write_file(path: Path, layers: int) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": layers, "context_length": 2048, "embedding_length": HIDDEN,
        "feed_forward_length": FFN, "head_count": HEADS, "head_count_kv": KV_HEADS,
    }.items():  # fmt: skip
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = [f"<0x{i:02X}>" for i in range(256)] + [f"t{i}" for i in range(VOCAB - 256)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(VOCAB)])
    writer.add_token_types([6] * 256 + [1] * (VOCAB - 256))
    for name, (shape, kind) in tensor_shapes(layers).items():
        values = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        writer.add_tensor(name, quantize(values, kind) if kind != Q.F32 else values, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16", "keep"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    try:
        path = work / "bench.Q4_K_M.gguf"
        start = time.perf_counter()
        write_file(path, args.layers)
        size_mb = path.stat().st_size / 1e6
        print(f"wrote {size_mb:.0f} MB Q4_K_M GGUF in {time.perf_counter() - start:.0f} s")
        for dtype in args.dtypes:
            result = convert_gguf(path, work / f"out-{dtype}", dtype=dtype)
            out_mb = sum(f.stat().st_size for f in result.path.iterdir()) / 1e6
            print(
                f"{dtype:8} {result.seconds:6.1f} s  {size_mb / result.seconds:6.1f} MB/s of GGUF"
                f"  -> {out_mb:.0f} MB folder  {json.dumps(result.tensor_types)}"
            )
            shutil.rmtree(result.path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
