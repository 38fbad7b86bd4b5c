"""Hub download speed: `omlx pull` and the admin API against a local fake Hub.

    .venv/bin/python benchmarks/bench_hub_download.py [--mb 100] [--runs 3]

The fake Hub (tests/fixtures/fake_hub.py) serves a repo holding a tiny llama config
and one ~MB-sized safetensors file over loopback; the real huggingface_hub client
downloads it in omlx's worker child. What this measures is omlx's own overhead on
top of huggingface_hub (child start, Hub API calls, disk writes, the final rename),
not a network: a real download is bounded by the link. Reports; never fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.fake_hub import FakeHub  # noqa: E402
from tests.fixtures.tiny_models import ARCH_CONFIGS  # noqa: E402

REPO = "bench/big-llama"


def build_repo(megabytes: int) -> dict[str, bytes]:
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        mx.save_safetensors(str(path), {"w": mx.zeros((megabytes * 1_000_000 // 4,))})
        weights = path.read_bytes()
    config = {**ARCH_CONFIGS["llama"], "vocab_size": 512}
    return {"config.json": json.dumps(config).encode(), "model.safetensors": weights}


def pull_once(hub: FakeHub, base: Path, name: str) -> float:
    env = {**os.environ, "HF_ENDPOINT": hub.url}
    cmd = [sys.executable, "-m", "omlx.cli", "--base-path", str(base), "pull", REPO, "--name", name]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pull failed: {done.stderr}")
    return elapsed


def api_once(hub: FakeHub, base: Path, name: str) -> float:
    import httpx

    from tests.fixtures.servers import live_server

    models = base / "models"
    models.mkdir(parents=True, exist_ok=True)
    with live_server(base, models, models={"hf_endpoint": hub.url, "load_at_start": False}) as srv:
        url = srv.base_url + "/admin/api/models/downloads"
        start = time.perf_counter()
        task = httpx.post(url, json={"repo_id": REPO, "name": name}, timeout=60).json()["task"]
        while (task := httpx.get(f"{url}/{task['id']}").json())["phase"] not in (
            "done",
            "failed",
        ):
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
    if task["phase"] != "done":
        raise SystemExit(f"download failed: {task['error']}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    files = build_repo(args.mb)
    total = sum(len(d) for d in files.values())
    with FakeHub() as hub, tempfile.TemporaryDirectory() as tmp:
        hub.add_repo(REPO, files)
        for label, once in (("omlx pull", pull_once), ("admin API", api_once)):
            times = [
                once(hub, Path(tmp) / label.replace(" ", "-"), f"m{i}") for i in range(args.runs)
            ]
            best, mb = min(times), total / 1e6
            runs = ", ".join(f"{t:.2f}" for t in times)
            print(
                f"{label:<10} {mb:.0f} MB: best {best:.2f} s = {mb / best:.0f} MB/s (runs {runs} s)"
            )


if __name__ == "__main__":
    main()
