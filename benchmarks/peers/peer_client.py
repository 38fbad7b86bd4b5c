"""Measure any OpenAI-compatible server by base URL and model (streaming chat).

    .venv/bin/python benchmarks/peers/peer_client.py --base-url http://127.0.0.1:8000/v1 \
        --model SmolLM2-135M-Instruct [--pid PID] [--tokens 128] [--quick] [--json out.json]

Rows (temperature 0, fixed prompts from prompts.py, the same request bodies for every
server): single-stream decode tok/s and TTFT; aggregate tok/s and mean/p99 TTFT at 8 and
16 concurrent streams; TTFT of a ~1,400-token prompt cold, repeated (prefix hit) and with
the server's own answer plus a short new turn appended (partial hit); peak RSS of the
server process and its children (psutil, sampled every 50 ms) when ``--pid`` is given;
the wall time of an agent session (``measure_agent``).
Tokens are counted from the server's ``usage`` (``stream_options.include_usage``).
TTFT = request sent -> first streamed chunk with text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import agent_messages, decode_messages, long_messages, next_turn

ROW_GROUPS = ("single", "c8", "c16", "long", "agent")


@dataclass(slots=True)
class Config:
    tokens: int = 128  # max_tokens of the decode rows
    long_lines: int = 80  # ~1,400 prompt tokens (SmolLM2: 1,407-1,409 by server)
    long_tokens: int = 32  # answer length of the long-prompt rows
    concurrency: tuple[int, ...] = (8, 16)
    single_runs: int = 2  # median of this many single-stream runs
    agent_turns: int = 10
    agent_tokens: int = 32  # answer cap per agent turn (the answers join the conversation)
    groups: tuple[str, ...] = ROW_GROUPS  # which rows run (ROW_GROUPS names them)
    # Names the agent session in its system prompt; the same for every server of a round,
    # so all get the same bytes (a fresh one each time when empty).
    agent_session: str = ""

    @classmethod
    def quick(cls) -> Config:
        return cls(tokens=32, long_lines=20, long_tokens=16, single_runs=1, agent_turns=3)


@dataclass(slots=True)
class StreamResult:
    ttft_s: float
    decode_s: float  # first -> last text chunk
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    text: str


@dataclass(slots=True)
class Report:
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)  # completion tokens per row
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int | None] = field(default_factory=dict)
    agent_ttft_s: list[float] = field(default_factory=list)  # per turn
    retries: int = 0  # connection errors retried (see PeerClient.chat)


class RssSampler:
    """Peak RSS of a process plus its children, sampled on a thread."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self._proc = psutil.Process(pid)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_bytes = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        procs = [self._proc, *self._proc.children(recursive=True)]
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                continue  # a child that ended between listing and reading
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_bytes = max(self.peak_bytes, self._sample())
            except psutil.NoSuchProcess:
                return
            self._stop.wait(self._interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(slots=True)
class PeerClient:
    http: httpx.AsyncClient
    model: str
    num_retries: int = 0  # connection errors retried, reported with the results

    async def chat(
        self, messages: list[dict], max_tokens: int, ignore_eos: bool = True
    ) -> StreamResult:
        """One streaming request. A connection error before any data is retried (at most
        twice, as the official openai client does); TTFT still counts from the first send."""
        start = time.perf_counter()
        body = chat_body(self.model, messages, max_tokens, ignore_eos)
        for attempt in range(3):
            try:
                return await _stream_once(self.http, body, start)
            except _Retryable:
                self.num_retries += 1
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


class _Retryable(RuntimeError):
    pass


def chat_body(model: str, messages: list[dict], max_tokens: int, ignore_eos: bool) -> dict:
    """The request body every server gets: greedy, streamed, usage in the last chunk."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # honoured where supported; prompts run long elsewhere
    return body


async def _stream_once(http: httpx.AsyncClient, body: dict, start: float) -> StreamResult:
    stamps: list[float] = []
    parts: list[str] = []
    usage = None
    try:
        async with http.stream("POST", "/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue  # SSE comments (keep-alives) and the end marker
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or delta.get("reasoning_content") or ""
                    if text:
                        stamps.append(time.perf_counter())
                        parts.append(text)
    except httpx.TransportError as exc:
        if stamps:
            raise
        raise _Retryable(repr(exc)) from exc
    if usage is None:
        raise RuntimeError("server sent no usage chunk (stream_options.include_usage)")
    if not stamps:
        raise RuntimeError("server streamed no text")
    details = usage.get("prompt_tokens_details") or {}
    return StreamResult(
        ttft_s=stamps[0] - start,
        decode_s=stamps[-1] - stamps[0],
        completion_tokens=usage["completion_tokens"],
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=details.get("cached_tokens"),
        text="".join(parts),
    )


def nonce() -> str:
    return uuid.uuid4().hex[:8]


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (the maximum for fewer than 100 samples)."""
    ordered = sorted(values)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


async def measure_single(client: PeerClient, cfg: Config, rep: Report) -> None:
    runs = []
    for _ in range(cfg.single_runs):
        runs.append(await client.chat(decode_messages(0, nonce()), cfg.tokens))
    # Chunks can merge tokens, so the rate counts usage tokens over the streamed span.
    rates = [(r.completion_tokens - 1) / r.decode_s for r in runs if r.decode_s > 0]
    rep.metrics["single_tok_s"] = statistics.median(rates) if rates else float("nan")
    rep.metrics["single_ttft_s"] = statistics.median(r.ttft_s for r in runs)
    rep.tokens["single"] = [r.completion_tokens for r in runs]


async def measure_concurrent(client: PeerClient, n: int, cfg: Config, rep: Report) -> None:
    tag = nonce()
    start = time.perf_counter()
    runs = await asyncio.gather(
        *(client.chat(decode_messages(i, tag), cfg.tokens) for i in range(n))
    )
    wall_s = time.perf_counter() - start
    rep.metrics[f"c{n}_tok_s"] = sum(r.completion_tokens for r in runs) / wall_s
    rep.metrics[f"c{n}_ttft_mean_s"] = statistics.fmean(r.ttft_s for r in runs)
    rep.metrics[f"c{n}_ttft_p99_s"] = p99([r.ttft_s for r in runs])
    rep.tokens[f"c{n}"] = [r.completion_tokens for r in runs]


async def measure_long(client: PeerClient, cfg: Config, rep: Report) -> None:
    messages = long_messages(nonce(), cfg.long_lines)
    cold = await client.chat(messages, cfg.long_tokens)
    hit = await client.chat(messages, cfg.long_tokens)
    partial = await client.chat(next_turn(messages, cold.text), cfg.long_tokens)
    for name, run in (("cold", cold), ("hit", hit), ("partial", partial)):
        rep.metrics[f"long_{name}_ttft_s"] = run.ttft_s
        rep.prompt_tokens[f"long_{name}"] = run.prompt_tokens
        rep.cached_tokens[f"long_{name}"] = run.cached_tokens
        rep.tokens[f"long_{name}"] = [run.completion_tokens]


async def agent_session(client: PeerClient, cfg: Config) -> tuple[float, list[StreamResult]]:
    """One agent session: turn k sends the conversation so far (the server's own answers
    included, as an agent sends them) plus a new tool result; returns the wall time of
    all turns and each turn's result. Answers stop at EOS (no ``ignore_eos``) or
    ``agent_tokens``, so a server's answers can differ from another's only where its
    greedy tokens do; the report keeps each turn's answer tokens and the last prompt's
    tokens to show it."""
    session, answers, runs = cfg.agent_session or nonce(), [], []
    start = time.perf_counter()
    for turn in range(cfg.agent_turns):
        messages = agent_messages(session, turn, answers)
        run = await client.chat(messages, cfg.agent_tokens, ignore_eos=False)
        answers.append(run.text)
        runs.append(run)
    return time.perf_counter() - start, runs


async def measure_agent(client: PeerClient, cfg: Config, rep: Report) -> None:
    wall_s, runs = await agent_session(client, cfg)
    rep.metrics["agent_wall_s"] = wall_s
    rep.metrics["agent_ttft_mean_s"] = statistics.fmean(r.ttft_s for r in runs)
    rep.agent_ttft_s = [r.ttft_s for r in runs]
    rep.tokens["agent"] = [r.completion_tokens for r in runs]
    rep.prompt_tokens["agent_last"] = runs[-1].prompt_tokens
    rep.cached_tokens["agent_last"] = runs[-1].cached_tokens


async def measure(base_url: str, model: str, cfg: Config, pid: int | None = None) -> Report:
    """Run the rows ``cfg.groups`` names against one server, in order; returns the report."""
    rep = Report()
    sampler = RssSampler(pid) if pid else None
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=900) as http:
        if sampler:
            sampler.__enter__()
        try:
            client = PeerClient(http, model)
            await client.chat(decode_messages(99, nonce()), 4)  # load + warm up
            if "single" in cfg.groups:
                await measure_single(client, cfg, rep)
            for n in cfg.concurrency:
                if f"c{n}" in cfg.groups:
                    await measure_concurrent(client, n, cfg, rep)
            if "long" in cfg.groups:
                await measure_long(client, cfg, rep)
            if "agent" in cfg.groups:
                await measure_agent(client, cfg, rep)
            rep.retries = client.num_retries
        finally:
            if sampler:
                sampler.__exit__()
    if sampler:
        rep.metrics["peak_rss_mb"] = sampler.peak_bytes / 2**20
    return rep


def parse_groups(text: str) -> tuple[str, ...]:
    """``--rows``: a comma list of ROW_GROUPS."""
    groups = tuple(g.strip() for g in text.split(",") if g.strip())
    unknown = sorted(set(groups) - set(ROW_GROUPS))
    if unknown or not groups:
        raise SystemExit(f"--rows: unknown {unknown}; pick from {','.join(ROW_GROUPS)}")
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--pid", type=int, help="server pid, for peak RSS")
    parser.add_argument("--tokens", type=int, help="max_tokens of the decode rows")
    parser.add_argument("--quick", action="store_true", help="short prompts and answers")
    parser.add_argument("--rows", default=",".join(ROW_GROUPS), help="comma list of rows")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    cfg = Config.quick() if args.quick else Config()
    cfg.groups = parse_groups(args.rows)
    if args.tokens:
        cfg.tokens = args.tokens
    rep = asyncio.run(measure(args.base_url, args.model, cfg, args.pid))
    for key, value in rep.metrics.items():
        print(f"{key:22} {value:10.3f}")
    print("completion tokens:", json.dumps(rep.tokens))
    print("prompt tokens:", json.dumps(rep.prompt_tokens), "cached:", json.dumps(rep.cached_tokens))
    if args.json:
        args.json.write_text(json.dumps(asdict(rep), indent=1))


if __name__ == "__main__":
    main()
