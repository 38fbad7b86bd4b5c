"""Realistic flood (issue 27's bar), run by ``bench_flood.py --realistic``.

A real ``omlx serve``, a tight ceiling, two models (the built-in SmolLM2 and a
random llama of the tests' ``slow-llama`` shape). Clients send plain and
structured (json_schema) chats of mixed lengths and prompts that cannot fit;
mid-flood the second model is loaded, given requests and unloaded, then every
model's weights and KV cache are released and resumed. Reported: outcomes, hung
requests, false 400s (re-checked against the live reading after the flood), peak
RSS and MLX peak against the ceiling, wall time. ``--compare-ref REF`` runs the
same prompts under the same ceiling against REF's code (``git archive``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import flood_models
import httpx
import psutil
from bench_cache import ROOT, ServerProc, conversation
from bench_flood import MB, MODEL, RssSampler
from flood_report import print_run, print_side_by_side

SECOND = "bench-second-llama"
# State-changing requests must prove they come from a real client (issue 22).
HEADERS = {"X-Omlx-Client": "bench-flood"}
STRUCTURED_FRACTION = 1 / 3
TOPIC = {"type": "string", "maxLength": 60}
CONFIDENCE = {"type": "integer", "minimum": 0, "maximum": 10}
SCHEMA = {
    "type": "object",
    "properties": {"topic": TOPIC, "confidence": CONFIDENCE},
    "required": ["topic", "confidence"],
}
# When the admin actions fire, as the fraction of flood requests that ended.
LOAD_SECOND_AT, RELEASE_AT = 0.15, 0.45
RELEASE_TAGS = ["kv_cache", "weights"]


# -- setup: models, trees, settings ---------------------------------------------


def prepare_models(source_dir: Path, work: Path, three_models: bool = False) -> Path:
    """``<work>/models``: SmolLM2 (hard links to ``source_dir``'s copy, installed
    there first if missing) and the second model, so the server sees exactly two."""
    models = work / "models"
    if not (source_dir / MODEL).exists():
        from omlx.models.builtin import install_default_model

        install_default_model(source_dir)
    shutil.copytree(source_dir / MODEL, models / MODEL, copy_function=_link_or_copy)
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.tiny_models import build_tiny_model

    build_tiny_model(models / SECOND, arch="slow-llama", seed=0)
    if three_models:
        flood_models.prepare(models)
    return models


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def extract_ref(ref: str, dest: Path) -> Path:
    """``git archive REF`` unpacked into ``dest``: reads .git, changes nothing in it."""
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", ref], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {ref} failed")
    return dest


def settings_fields(tree: Path) -> dict[str, set[str]]:
    """The settings groups and fields the tree's server knows (older code has fewer)."""
    code = (
        "import json; from omlx.settings import Settings; print(json.dumps({n: "
        "sorted(f.annotation.model_fields) for n, f in Settings.model_fields.items() "
        "if hasattr(f.annotation, 'model_fields')}))"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    return {group: set(names) for group, names in json.loads(out.stdout).items()}


def write_settings(base: Path, wanted: dict, known: dict[str, set[str]]) -> list[str]:
    """Write ``wanted`` to the settings file the server reads, keeping only fields
    the tree knows; returns the ones left out."""
    kept: dict[str, dict] = {}
    dropped = []
    for group, fields in wanted.items():
        for name, value in fields.items():
            if name in known.get(group, set()):
                kept.setdefault(group, {})[name] = value
            else:
                dropped.append(f"{group}.{name}")
    base.mkdir(parents=True, exist_ok=True)
    (base / "settings.json").write_text(json.dumps(kept, indent=2))
    return dropped


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(tree: Path, base: Path, models: Path, wanted: dict) -> tuple[ServerProc, list]:
    dropped = write_settings(base, wanted, settings_fields(tree))
    env = {"PYTHONPATH": str(tree)}
    server = ServerProc(base, free_port(), env, base.with_suffix(".log"), models, cwd=tree)
    server.start()
    return server, dropped


# -- the probe and the ceiling ----------------------------------------------------


def probe(models: Path, work: Path, served: tuple[str, ...]) -> Live:
    """The current tree's server, default ceiling: what the served models loaded hold."""
    wanted = {"cache": {"enabled": False}, "models": {"install_default_model": False}}
    server, _ = start_server(ROOT, work / "probe", models, wanted)
    try:
        for name in served[1:]:
            httpx.post(f"{server.url}/admin/api/models/{name}/load", headers=HEADERS, timeout=600)
        return _read_live(server.url)
    finally:
        server.stop()


def ceiling_bytes(args: argparse.Namespace, p: Live) -> int:
    """``--ceiling``, or the model loaded + its margin + room for about
    ``--room-prompts`` of the longest prompts (KV twice for the growth copy, plus
    the measured step transient): what the existing flood does."""
    if args.ceiling:
        from omlx.sizes import parse_byte_size

        total = psutil.virtual_memory().total
        return parse_byte_size(args.ceiling, total_bytes=total, field="--ceiling")
    per_prompt = 2 * p.kv_per_token * max(args.lengths) + p.overhead
    return int(p.resident + p.margin + args.room_prompts * per_prompt)


# -- the plan: the same prompts for every run --------------------------------------


@dataclass(frozen=True)
class Ask:
    index: int
    model: str
    kind: str  # plain / structured / oversized / second
    messages: list
    max_tokens: int
    structured: bool = False
    ignore_eos: bool = False


@dataclass
class Plan:
    clients: list[list[Ask]]
    oversized: list[Ask]
    second: list[Ask]
    # --three-models: the second and the vision model's clients, for the whole flood.
    others: list[list[Ask]] = field(default_factory=list)

    @property
    def num_flood(self) -> int:
        return sum(len(c) for c in self.clients + self.others) + len(self.oversized)


def make_plan(args, tokenizer, p: Live, ceiling: int) -> Plan:
    if min(args.lengths) < 64:  # the chat's frame alone takes ~40 tokens
        raise SystemExit("--lengths: every prompt length must be at least 64 tokens")
    rng = random.Random(args.seed)
    clients, index = [], 0
    for _ in range(args.clients):
        asks = []
        for _ in range(args.requests_per_client):
            length = rng.choice(args.lengths)
            structured = rng.random() < STRUCTURED_FRACTION
            messages = conversation(tokenizer, length, index)
            kind = f"{'structured' if structured else 'plain'} {length}"
            asks.append(Ask(index, MODEL, kind, messages, args.max_tokens, structured))
            index += 1
        clients.append(asks)
    config = json.loads((args.models / MODEL / "config.json").read_text())
    context = config["max_position_embeddings"]
    words = "word " * (context + 256)
    oversized = [_single(index, MODEL, f"over context ~{context + 256}", words, 4)]
    # KV alone (twice: the growth copy) exceeds what the ceiling leaves beside the model.
    by_memory = math.ceil(1.1 * (ceiling - p.resident) / (2 * p.kv_per_token))
    if by_memory + args.max_tokens < context:
        words = "word " * by_memory
        oversized.append(_single(index + 1, MODEL, f"over memory ~{by_memory}", words, 4))
    ship = "Tell me about ship {}."
    second = [_single(1000 + i, SECOND, "second", ship.format(i), 128, True) for i in range(3)]
    if args.three_models:  # the second model serves all along instead
        others = flood_models.clients(args, Ask, SECOND, first_index=2000)
        return Plan(clients, oversized, [], others)
    return Plan(clients, oversized, second)


def _single(index: int, model: str, kind: str, text: str, max_tokens: int, eos=False) -> Ask:
    """A one-message chat; ``eos`` True ignores EOS (keeps the request in flight)."""
    messages = [{"role": "user", "content": f"Request {index}. {text}"}]
    return Ask(index, model, kind, messages, max_tokens, ignore_eos=eos)


# -- one run ------------------------------------------------------------------


@dataclass
class Outcome:
    ask: Ask
    label: str  # "completed", "400 prefill_memory_exceeded", "503 <code>", "hung", ...
    message: str
    seconds: float
    ended_at_s: float


@dataclass
class Peaks:
    mlx: int = 0  # MLX active (+ its buffer cache) and the server's windowed peak
    footprint: int = 0  # the server's own footprint reading
    num_readings: int = 0


@dataclass
class RunResult:
    label: str
    ceiling: int
    dropped_settings: list[str]
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    peaks: Peaks = field(default_factory=Peaks)
    max_rss: int = 0
    num_samples: int = 0
    seconds: float = 0.0
    rechecks: list[str] = field(default_factory=list)
    num_false_400: int = 0
    counters: dict = field(default_factory=dict)


class Progress:
    """How many flood requests ended; admin actions wait for a fraction of them."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self._changed = asyncio.Condition()

    async def add(self) -> None:
        async with self._changed:
            self.done += 1
            self._changed.notify_all()

    async def reach(self, fraction: float) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.done >= fraction * self.total)


def _request_body(ask: Ask) -> dict:
    body = {"model": ask.model, "messages": ask.messages, "max_tokens": ask.max_tokens}
    body["temperature"] = 0
    if ask.structured:
        schema = {"name": "summary", "schema": SCHEMA}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if ask.ignore_eos:
        body["ignore_eos"] = True
    return body


def _label(resp: httpx.Response) -> tuple[str, str]:
    if resp.status_code == 200:
        return "completed", ""
    try:
        error = resp.json().get("error", {})
    except ValueError:
        return f"{resp.status_code} (not JSON)", resp.text[:200]
    return f"{resp.status_code} {error.get('code')}", str(error.get("message", ""))


@dataclass
class Flood:
    """One flood in progress: every request and admin call is bounded by ``bound_s``."""

    http: httpx.AsyncClient
    bound_s: float
    progress: Progress
    result: RunResult
    t0: float = field(default_factory=time.perf_counter)

    async def ask(self, ask: Ask) -> Outcome:
        start = time.perf_counter()
        try:
            post = self.http.post("/v1/chat/completions", json=_request_body(ask))
            label, message = _label(await asyncio.wait_for(post, self.bound_s))
        except TimeoutError:
            label, message = "hung", f"not ended after {self.bound_s:.0f} s"
        except httpx.HTTPError as exc:
            label, message = f"transport {type(exc).__name__}", str(exc)
        end = time.perf_counter()
        return Outcome(ask, label, message, end - start, end - self.t0)

    async def client(self, asks: list[Ask]) -> None:
        """One client: its requests one after another."""
        for ask in asks:
            self.result.outcomes.append(await self.ask(ask))
            await self.progress.add()

    async def admin(self, what: str, path: str, body: dict) -> None:
        """One admin POST, logged with its status and time."""
        start = time.perf_counter()
        try:
            resp = await asyncio.wait_for(self.http.post(path, json=body), self.bound_s)
            answer = f"{resp.status_code} {resp.text[:160]}"
        except TimeoutError:
            answer = f"HUNG (no answer in {self.bound_s:.0f} s)"
        except httpx.HTTPError as exc:
            answer = f"transport {type(exc).__name__}"
        took = time.perf_counter() - start
        self.result.events.append(f"t={start - self.t0:6.1f}s {what}: {answer} ({took:.1f} s)")

    async def timeline(self, plan: Plan) -> None:
        """Mid-flood: load the second model, send it requests, unload it while they
        run; later release the weights and KV cache of every model and resume."""
        if plan.others:  # --three-models: the guard across models, nothing released
            return
        if plan.second:
            await self.progress.reach(LOAD_SECOND_AT)
            await self.admin(f"load {SECOND}", f"/admin/api/models/{SECOND}/load", {})
            second = [asyncio.create_task(self.ask(a)) for a in plan.second]
            await asyncio.sleep(1.0)
            unload = f"/admin/api/models/{SECOND}/unload"
            await self.admin(f"unload {SECOND}", unload, {"drain_s": 0.5})
            self.result.outcomes.extend(await asyncio.gather(*second))
        await self.progress.reach(RELEASE_AT)
        release = {"tags": RELEASE_TAGS, "timeout_s": 30}
        await self.admin("release", "/admin/api/memory/release", release)
        await asyncio.sleep(2.0)
        await self.admin("resume", "/admin/api/memory/resume", {"tags": RELEASE_TAGS})


async def watch_memory(http: httpx.AsyncClient, done: asyncio.Event, peaks: Peaks) -> None:
    while not done.is_set():
        try:
            reading = (await http.get("/admin/api/memory", timeout=10)).json()["reading"]
        except (httpx.HTTPError, ValueError, KeyError):
            await asyncio.sleep(0.1)
            continue
        mlx = reading.get("mlx_active_bytes", 0) + reading.get("mlx_cache_bytes", 0)
        peaks.mlx = max(peaks.mlx, mlx, reading.get("recent_peak_bytes", 0))
        peaks.footprint = max(peaks.footprint, reading.get("process_footprint_bytes", 0))
        peaks.num_readings += 1
        await asyncio.sleep(0.1)


async def flood(server: ServerProc, plan: Plan, args, result: RunResult, probed: Live) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout + 60)  # the bound (wait_for) ends a request first
    client = httpx.AsyncClient(base_url=server.url, timeout=timeout, headers=HEADERS, limits=limits)
    async with client as http:
        for name in _served(args):
            loaded = await http.post(f"/admin/api/models/{name}/load", json={})
            if loaded.status_code != 200:  # older code may refuse it under the ceiling
                what = f"{loaded.status_code} {loaded.text[:160]}"
                result.events.append(f"first load of {name}: {what}")
        sampler = RssSampler(server.proc.pid)
        sampler.start()
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_memory(http, done, result.peaks))
        run = Flood(http, args.timeout, Progress(plan.num_flood), result)
        clients = [[a] for a in plan.oversized] + plan.clients + plan.others
        await asyncio.gather(run.timeline(plan), *(run.client(asks) for asks in clients))
        result.seconds = time.perf_counter() - run.t0
        done.set()
        await watcher
        sampler.stop.set()
        sampler.join()
        result.max_rss, result.num_samples = sampler.max_rss, sampler.num_samples
        await recheck(http, result, args, probed)
        await flood_models.recheck_alone(run, result, _served(args)[1:])


def _served(args) -> tuple[str, ...]:
    """The models loaded before the flood (the probe's reading holds them all)."""
    return (MODEL, SECOND, flood_models.VISION) if args.three_models else (MODEL,)


# -- the false-400 re-check ----------------------------------------------------------


@dataclass(frozen=True)
class Live:
    resident: int
    hard: int
    margin: int
    kv_per_token: int
    chunk: int
    profile: dict
    counters: dict

    @property
    def overhead(self) -> int:
        """The auto-profile's measured worst step transient."""
        return self.profile.get("overhead_bytes", 0)


def _read_live(url: str) -> Live:
    """SmolLM2 loaded and idle: the server's live reading, limits and KV profile."""
    with httpx.Client(base_url=url, timeout=600, headers=HEADERS) as http:
        http.post(f"/admin/api/models/{MODEL}/load", json={}).raise_for_status()
        time.sleep(1.5)  # the load's transients leave the recent window
        memory = http.get("/admin/api/memory").json()
        rows = http.get("/admin/api/models").json()["models"]
    row = next(m for m in rows if m["name"] == MODEL)
    describe = memory["guards"][MODEL]
    profile = row.get("kv_profile") or {}
    margin = profile.get("margin_bytes") or _margin_for(profile, memory)
    return Live(
        resident=memory["current_bytes"],
        hard=memory["limit_bytes"],
        margin=margin,
        kv_per_token=int(re.search(r"KV (\d+) B/token", describe).group(1)),
        chunk=int(re.search(r"prefill chunk (\d+)", describe).group(1)),
        profile=profile,
        counters={k: row.get(k, 0) for k in ("num_deferrals", "num_gated")},
    )


def _margin_for(profile: dict, memory: dict) -> int:
    """Code older than the measured margin: today's rule on its own measured transient."""
    from omlx.memory.budget import measured_margin_bytes

    if "overhead_bytes" in profile:
        return measured_margin_bytes(profile["overhead_bytes"])
    return memory["transient_margin_bytes"]


async def recheck(http: httpx.AsyncClient, result: RunResult, args, probed: Live) -> None:
    """Each 400 prefill_memory_exceeded against the live reading after the flood,
    with nothing in flight: the front door's own estimate (KV, growth copy,
    attention, measured transient) plus the safety canary, under the ceiling?
    When this server cannot give one, the probe's reading under this ceiling."""
    try:
        live = await asyncio.to_thread(_read_live, str(http.base_url))
        result.counters = live.counters
    except (httpx.HTTPError, KeyError, StopIteration, AttributeError) as exc:
        result.rechecks.append(f"no live reading ({exc!r}); the probe's reading is used")
        live = dataclasses.replace(probed, hard=result.ceiling)
    dims = _smollm_dims(args.models, live.kv_per_token)
    for outcome in result.outcomes:
        if outcome.label != "400 prefill_memory_exceeded" or outcome.ask.model != MODEL:
            continue
        line, could_fit = _recheck_one(outcome, live, dims)
        result.num_false_400 += could_fit
        result.rechecks.append(line)
    result.rechecks.insert(
        0,
        f"after the flood: resident {live.resident / MB:.0f} MiB, hard "
        f"{live.hard / MB:.0f} MiB, margin {live.margin / MB:.0f} MiB, step transient "
        f"{live.overhead / MB:.0f} MiB, chunk {live.chunk}",
    )


def _smollm_dims(models: Path, kv_per_token: int):
    from omlx.memory.dims import model_dims

    config = json.loads((models / MODEL / "config.json").read_text())
    dims = model_dims(config, kv_dtype_bytes=1)
    return model_dims(config, kv_dtype_bytes=kv_per_token // dims.kv_bytes_per_token)


def _recheck_one(outcome: Outcome, live: Live, dims) -> tuple[str, bool]:
    from omlx.memory.budget import Limits, canary_bytes, held_tokens_peak_bytes

    found = re.search(r"\((\d+) tokens\)", outcome.message)
    if found is None:
        return f"  #{outcome.ask.index} {outcome.ask.kind}: no token count in the message", False
    tokens = int(found.group(1))
    limits = Limits(live.hard, live.hard, live.margin)
    need = canary_bytes(limits) + held_tokens_peak_bytes(
        limits,
        dims,
        tokens=tokens,
        baseline_bytes=live.resident,
        chunk_tokens=live.chunk,
        overhead_bytes=live.overhead,
        unmodeled_bytes=live.profile.get("unmodeled_bytes", 0),
    )
    fits = need <= live.hard
    verdict = "FALSE 400: it fits now" if fits else "could not fit"
    line = (
        f"  #{outcome.ask.index} {outcome.ask.kind}, {tokens} tokens, refused at "
        f"t={outcome.ended_at_s:.1f}s: needs {need / MB:.0f} MiB vs hard "
        f"{live.hard / MB:.0f} MiB: {verdict}"
    )
    return line, fits


# -- runs and the report -----------------------------------------------------------


def run_tree(label: str, tree: Path, work: Path, plan: Plan, probed: Live, args) -> RunResult:
    ceiling = args.ceiling_bytes
    wanted = {
        "cache": {"enabled": False},
        "models": {"install_default_model": False},
        "memory": {"max_process_memory": ceiling},
    }
    base = work / re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")
    server, dropped = start_server(tree, base, args.models, wanted)
    result = RunResult(label, ceiling, dropped)
    print(f"[{label}] serving from {tree}, log {base.with_suffix('.log')}", flush=True)
    try:
        asyncio.run(flood(server, plan, args, result, probed))
    finally:
        server.stop()
    return result


def main_realistic(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="omlx-flood-realistic-"))
    print(f"work folder (models, settings, server logs; kept): {work}", flush=True)
    args.models = prepare_models(args.model_dir, work, args.three_models)
    tokenizer = AutoTokenizer.from_pretrained(str(args.models / MODEL))
    p = probe(args.models, work, _served(args))
    ceiling = args.ceiling_bytes = ceiling_bytes(args, p)
    print(
        f"SmolLM2 loaded holds {p.resident / MB:.0f} MiB (margin {p.margin / MB:.0f} MiB, step "
        f"transient {p.overhead / MB:.0f} MiB); ceiling {ceiling / MB:.0f} MiB",
        flush=True,
    )
    plan = make_plan(args, tokenizer, p, ceiling)
    print(
        f"plan: {plan.num_flood} flood requests, {len(plan.second)} to {SECOND} later", flush=True
    )
    results = [run_tree("working tree", ROOT, work, plan, p, args)]
    if args.compare_ref:
        tree = extract_ref(args.compare_ref, work / "ref-tree")
        results.append(run_tree(args.compare_ref, tree, work, plan, p, args))
    for result in results:
        print_run(result, args.timeout)
    if len(results) == 2:
        print_side_by_side(*results)
