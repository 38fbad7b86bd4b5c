"""Memory flood benchmark: many long prompts against a small ceiling, and the guard's cost.

    .venv/bin/python benchmarks/bench_flood.py [--model-dir DIR] [--clients 16]
        [--prompt-tokens 1500] [--room-prompts 2] [--skip-flood] [--skip-overhead]
    .venv/bin/python benchmarks/bench_flood.py --realistic [--clients 12]
        [--requests-per-client 3] [--ceiling 1200MB] [--compare-ref 06b521d]

1. Flood (a real ``omlx serve``, SmolLM2 float32, prefix cache off so every prompt
   is prefilled in full): the server is started once with the default ceiling to
   read what it holds with the model loaded, then restarted with
   ``max_process_memory`` = that + the transient margin + room for about
   ``--room-prompts`` concurrent prompts. ``--clients`` clients each send a
   different ~``--prompt-tokens``-token chat at once, plus one prompt larger than
   the model's KV capacity. Reported: completed, queued (memory admission
   deferrals), refused at the front door (400), ended by the forward gate (503),
   and the highest process footprint (psutil RSS of the server, sampled every
   few ms) and MLX peak (the server's own windowed reading) against the ceiling.
2. Guard overhead (in process, ample ceiling): aggregate decode tok/s of 8
   concurrent greedy streams with the real guard vs with every guard check
   disabled, interleaved pairs. Target: on >= 0.97 x off.
3. ``--realistic`` (issue 27's bar; benchmarks/flood_realistic.py): a tight
   ceiling, two models (one loaded and unloaded mid-flood), plain and structured
   requests of mixed lengths, a release/resume cycle in the middle; reports hung
   requests, every outcome, false 400s, peaks against the ceiling; with
   ``--compare-ref REF`` the same run against another commit's code.
Targets are reported, never enforced: the exit code is always 0.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cache import ServerProc, conversation

MODEL = "SmolLM2-135M-Instruct"
MB = 1024**2


# -- 1. flood ------------------------------------------------------------------


class RssSampler(threading.Thread):
    """The server's resident memory every few milliseconds; keeps the maximum."""

    def __init__(self, pid: int, period_s: float = 0.003):
        super().__init__(daemon=True)
        self._proc = psutil.Process(pid)
        self._period = period_s
        self.max_rss = 0
        self.num_samples = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.max_rss = max(self.max_rss, self._proc.memory_info().rss)
            except psutil.Error:
                return
            self.num_samples += 1
            time.sleep(self._period)


@dataclass
class FloodResult:
    ceiling: int
    baseline: int
    statuses: dict[str, int]
    num_deferrals: int
    num_gated: int
    max_rss: int
    max_mlx_peak: int
    seconds: float
    num_samples: int


async def _ask(http: httpx.AsyncClient, messages: list, max_tokens: int) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    resp = await http.post("/v1/chat/completions", json=body, timeout=1800)
    if resp.status_code == 200:
        return "completed"
    code = resp.json().get("error", {}).get("code")
    return f"{resp.status_code} {code}"


async def _watch_mlx(http: httpx.AsyncClient, done: asyncio.Event) -> int:
    top = 0
    while not done.is_set():
        reading = (await http.get("/admin/api/memory")).json()["reading"]
        top = max(top, reading["mlx_active_bytes"], reading["recent_peak_bytes"])
        await asyncio.sleep(0.1)
    return top


def _loaded_state(server: ServerProc) -> tuple[int, dict]:
    """What the server holds with the model loaded, and the model's status row."""
    with httpx.Client(base_url=server.url, timeout=600) as http:
        http.post("/admin/api/models/" + MODEL + "/load", json={}).raise_for_status()
        time.sleep(1.5)  # the load's transients leave the recent window
        memory = http.get("/admin/api/memory").json()
        row = next(m for m in http.get("/admin/api/models").json()["models"] if m["name"] == MODEL)
    return memory["current_bytes"], row


def flood(args: argparse.Namespace, tokenizer) -> FloodResult:
    margin = 128 * MB
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        print(f"logs: {base}/probe.log, {base}/flood.log (kept until the run ends)")
        env = {"OMLX_CACHE__ENABLED": "false", "OMLX_MEMORY__PREFILL_TRANSIENT_MARGIN": "128MB"}
        probe = ServerProc(base / "probe", args.port, env, base / "probe.log", args.model_dir)
        (base / "probe").mkdir()
        probe.start()
        baseline, row = _loaded_state(probe)
        probe.stop()
        profile = row["kv_profile"]
        kv_per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2 float32: layers x kv heads x head dim
        per_prompt = 2 * kv_per_token * args.prompt_tokens + profile["overhead_bytes"]
        ceiling = int(baseline + margin + args.room_prompts * per_prompt)
        env["OMLX_MEMORY__MAX_PROCESS_MEMORY"] = str(ceiling)
        server = ServerProc(base / "flood", args.port, env, base / "flood.log", args.model_dir)
        (base / "flood").mkdir()
        server.start()
        try:
            _loaded_state(server)
            return asyncio.run(_flood(server, args, tokenizer, ceiling, baseline))
        except Exception:
            print((base / "flood.log").read_text()[-6000:])
            raise
        finally:
            if server.proc is not None and server.proc.poll() is None:
                server.stop()


async def _flood(server: ServerProc, args, tokenizer, ceiling: int, baseline: int) -> FloodResult:
    sampler = RssSampler(server.proc.pid)
    sampler.start()
    prompts = [conversation(tokenizer, args.prompt_tokens, s) for s in range(args.clients)]
    async with httpx.AsyncClient(base_url=server.url, timeout=1800) as http:
        row = next(m for m in (await http.get("/admin/api/models")).json()["models"])
        capacity = row["kv_profile"]["max_kv_tokens"]
        huge = [{"role": "user", "content": "word " * (capacity + 100)}]
        done = asyncio.Event()
        watcher = asyncio.create_task(_watch_mlx(http, done))
        start = time.perf_counter()
        outcomes = await asyncio.gather(
            *(_ask(http, p, args.max_tokens) for p in prompts), _ask(http, huge, 4)
        )
        seconds = time.perf_counter() - start
        done.set()
        max_mlx = await watcher
        row = next(
            m for m in (await http.get("/admin/api/models")).json()["models"] if m["name"] == MODEL
        )
    sampler.stop.set()
    sampler.join()
    statuses: dict[str, int] = {}
    for outcome in outcomes:
        statuses[outcome] = statuses.get(outcome, 0) + 1
    return FloodResult(
        ceiling,
        baseline,
        statuses,
        row["num_deferrals"],
        row["num_gated"],
        sampler.max_rss,
        max_mlx,
        seconds,
        sampler.num_samples,
    )


# -- 2. guard overhead ---------------------------------------------------------


def guard_overhead(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    from omlx.engine.pool import EnginePool
    from omlx.engine.worker import MLXWorker
    from omlx.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(
            base_path=Path(tmp),
            models={"model_dirs": [args.model_dir]},
            cache={"enabled": False},
            scheduler={"max_concurrent_requests": 8},
        )
        worker = MLXWorker()
        worker.start()
        pool = EnginePool(settings, worker)
        try:
            return asyncio.run(_overhead_pairs(pool, args.pairs))
        finally:
            asyncio.run(pool.close())
            worker.stop()


class _NoGuard:
    """Every guard check passes and no memory is read: the guard switched off."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def admit(self, *args, **kwargs) -> bool:
        return True

    def gate(self, *args, **kwargs) -> bool:
        return True

    def kv_fits(self, *args, **kwargs) -> bool:
        return True

    def check_prefill(self, *args, **kwargs) -> None:
        return None


class _FrozenProbe:
    def __init__(self, reading) -> None:
        self._reading = reading

    def reading(self, *, fresh: bool = False):
        return self._reading


async def _overhead_pairs(pool, pairs: int) -> tuple[list[float], list[float]]:
    engine = await pool.get_engine(MODEL)
    real_guard, real_probe = engine.guard, engine.probe
    off_guard, off_probe = _NoGuard(real_guard), _FrozenProbe(real_probe.reading(fresh=True))
    await _aggregate_tok_s(engine, tag="warm")
    on, off = [], []
    for i in range(pairs):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            guarded = mode == "on"
            engine.guard = real_guard if guarded else off_guard
            engine.probe = real_probe if guarded else off_probe
            (on if guarded else off).append(await _aggregate_tok_s(engine, tag=f"{mode}{i}"))
    engine.guard, engine.probe = real_guard, real_probe
    return on, off


async def _aggregate_tok_s(engine, *, tag: str, streams: int = 8, max_tokens: int = 96) -> float:
    from omlx.engine.stream import RequestStream
    from omlx.scheduler import Request, SamplingParams

    async def one(i: int) -> int:
        stream = RequestStream(f"{tag}-{i}", asyncio.get_running_loop())
        prompt = tuple(1000 + (i * 37 + j) % 5000 for j in range(64))
        engine.submit(
            Request(stream.request_id, prompt, SamplingParams(0.0, max_tokens=max_tokens)),
            stream,
        )
        while True:
            event = await stream.get()
            if event.error is not None:
                raise event.error
            if event.finish_reason:
                return event.num_output_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    return tokens / (time.perf_counter() - start)


# -- report ----------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".omlx" / "models")
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--clients", type=int, help="default 16 (12 with --realistic)")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--room-prompts", type=float, default=2.0)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--skip-flood", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    real = ap.add_argument_group("--realistic")
    real.add_argument("--realistic", action="store_true", help="run the realistic flood only")
    real.add_argument("--ceiling", help="max_process_memory, e.g. 1200MB (default: computed)")
    real.add_argument("--compare-ref", metavar="REF", help="also run REF's code (git archive)")
    real.add_argument("--requests-per-client", type=int, default=3)
    real.add_argument("--lengths", type=int, nargs="+", default=[64, 300, 800, 1500])
    real.add_argument("--timeout", type=float, default=600.0, help="per-request bound (s)")
    real.add_argument("--seed", type=int, default=0)
    real.add_argument(
        "--three-models",
        action="store_true",
        help="the second model and a vision model flooded beside SmolLM2 (issue 40)",
    )
    real.add_argument("--extra-clients", type=int, default=3, help="per extra model")
    args = ap.parse_args()
    if args.realistic:
        from flood_realistic import main_realistic

        args.clients = args.clients or 12
        main_realistic(args)
        return
    args.clients = args.clients or 16
    if not args.port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]

    if not args.skip_flood:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir / MODEL))
        r = flood(args, tokenizer)
        print(f"flood: {args.clients} clients x ~{args.prompt_tokens} tokens + 1 oversized")
        print(f"  ceiling {r.ceiling / MB:.0f} MiB (model loaded: {r.baseline / MB:.0f} MiB)")
        print(f"  outcomes {r.statuses} in {r.seconds:.1f} s")
        print(f"  memory admission deferrals {r.num_deferrals}, forward-gate ends {r.num_gated}")
        rss_ok = "ok" if r.max_rss <= r.ceiling else "OVER"
        mlx_ok = "ok" if r.max_mlx_peak <= r.ceiling else "OVER"
        print(
            f"  max RSS {r.max_rss / MB:.0f} MiB ({r.max_rss / r.ceiling:.3f} of ceiling, "
            f"{r.num_samples} samples) {rss_ok}"
        )
        print(
            f"  max MLX peak {r.max_mlx_peak / MB:.0f} MiB "
            f"({r.max_mlx_peak / r.ceiling:.3f} of ceiling) {mlx_ok}"
        )
    if not args.skip_overhead:
        on, off = guard_overhead(args)
        ratio = statistics.median(on) / statistics.median(off)
        print("guard overhead: aggregate tok/s, 8 streams x 96 tokens, interleaved pairs")
        print(f"  on  {[round(x, 1) for x in on]} median {statistics.median(on):.1f}")
        print(f"  off {[round(x, 1) for x in off]} median {statistics.median(off):.1f}")
        print(f"  on/off {ratio:.3f} (target >= 0.97) {'ok' if ratio >= 0.97 else 'MISS'}")


if __name__ == "__main__":
    main()
