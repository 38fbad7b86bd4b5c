"""A process that generated on the MLX worker exits cleanly (no abort at shutdown)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, sys
from pathlib import Path
from omlx.engine.pool import EnginePool
from omlx.engine.stream import RequestStream
from omlx.engine.worker import MLXWorker
from omlx.scheduler import Request, SamplingParams
from omlx.settings import Settings

worker = MLXWorker()
worker.start()
settings = Settings(base_path=sys.argv[2], models={"model_dirs": [Path(sys.argv[1])]})
pool = EnginePool(settings, worker)

async def main():
    engine = await pool.get_engine("tiny-llama")
    stream = RequestStream("r", asyncio.get_running_loop())
    engine.submit(Request("r", (1, 2, 3), SamplingParams(1.0, top_p=0.9, max_tokens=3)), stream)
    while not (await stream.get()).finished:
        pass
    await pool.close()

asyncio.run(main())
worker.stop()
"""


def test_process_exits_cleanly_after_generating(tiny_models_dir: Path, tmp_path: Path) -> None:
    # The abort this guards against (a thread-local MLX cache torn down during
    # interpreter shutdown) was a race that hit most runs; four runs catch it.
    for _ in range(4):
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tiny_models_dir), str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
