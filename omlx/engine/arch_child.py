"""The probe process of engine/arch_probe.py: load a model folder the way the server
does (models/loader.py: GGUF, VLMs and quantized folders alike) and run the forwards
the server runs first. Its exit says whether this architecture may run in the server:

- 0: every forward ran;
- ``RAISED``: a Python error (a bad folder, a refused batch shape): not a crash, the
  server's own load reports it with its message;
- anything else, or a signal: the forward killed the process (issue 41, defect 7).

Usage: ``python -m omlx.engine.arch_child '<ModelInfo as JSON>' <prefill chunk>``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import mlx.core as mx

from omlx.engine.unbatched import batch_probe
from omlx.mlx_types import LanguageModel, prompt_cache
from omlx.models.discovery import ModelInfo
from omlx.models.loader import load_model

RAISED = 3
# A solo prompt of this many tokens; mlx-lm's phi3small dies on the CPU backend from 12.
PROMPT_TOKENS = 40
# The most tokens a prefill chunk of the probe holds: at least two chunks, one that
# starts the cache and one that continues it, whatever the server's chunk is.
MAX_CHUNK = 16


def run_forwards(lm: LanguageModel, vocab_size: int, chunk: int) -> None:
    """Prefill a solo prompt chunk by chunk, decode one token, then one batched step of
    the runner's prefill (the load's own batch probe), on fresh caches."""
    ids = [(j * 7) % (vocab_size - 1) + 1 for j in range(PROMPT_TOKENS)]
    cache = prompt_cache(lm)
    step = max(1, min(chunk, MAX_CHUNK))
    for start in range(0, len(ids), step):
        mx.eval(lm(mx.array([ids[start : start + step]]), cache=cache))
    mx.eval(lm(mx.array([[ids[0]]]), cache=cache))
    # The batch probe turns a Python refusal into a reason; only a crash ends here.
    batch_probe(lm, vocab_size)


def main(argv: list[str]) -> int:
    try:
        spec = json.loads(argv[1])
        info = ModelInfo(
            spec["name"],
            Path(spec["path"]),
            spec["model_type"],
            spec["kind"],
            spec["size_bytes"],
            spec["trust_remote_code"],
        )
        loaded = load_model(info)
        run_forwards(loaded.model, loaded.vocab_size, int(argv[2]))
    except Exception:
        traceback.print_exc()
        return RAISED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
