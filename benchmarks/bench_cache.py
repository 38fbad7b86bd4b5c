"""Prefix-cache benchmark: time to first token with and without a cache hit, one run.

    .venv/bin/python benchmarks/bench_cache.py [--model-dir DIR] [--prompt-tokens 2000]

Against real ``omlx serve`` processes on fresh temp base paths (SmolLM2 float32,
temperature 0, streaming; TTFT = request sent -> first content chunk):
  - cold vs RAM hit: a ~2,000-token chat prompt built from the repo's docs, then
    the same prompt again;
  - SSD hit: the server is stopped with SIGINT (write-back flushes RAM blocks to
    the SSD) and restarted on the same base path; the model is loaded by a short
    request first, so the number is the hit alone;
  - next turn: the conversation plus the model's answer and one short new user
    turn, against that conversation's cold TTFT on a server with the cache off;
  - decode tok/s with the cache on vs off, interleaved runs with ``ignore_eos``.
Each TTFT row uses ``--repeats`` conversations that differ from their first
token, so every cold run is really cold. Targets are reported, never enforced:
the exit code is always 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "tests/fixtures/corpus.txt"]
FOLLOW_UP = "Thanks. Now give me the three most important points as a short list."


# -- prompts -----------------------------------------------------------------


def conversation(tokenizer, num_tokens: int, session: int) -> list[dict[str, str]]:
    """A system + user conversation of about ``num_tokens`` templated tokens whose
    first tokens name ``session`` (so no two sessions share a cache block)."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in DOCS if p.exists())
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens:
        ids = ids + ids
    system = f"Session {session}. You are a careful assistant who answers from the document."
    body = tokenizer.decode(ids[:num_tokens])
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Read this document:\n\n{body}\n\nWhat is it about?"},
    ]
    extra = count_tokens(tokenizer, messages) - num_tokens
    if extra > 0:  # the template and question added tokens: cut the document to fit
        body = tokenizer.decode(ids[: num_tokens - extra])
        messages[1]["content"] = f"Read this document:\n\n{body}\n\nWhat is it about?"
    return messages


def count_tokens(tokenizer, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


# -- servers -----------------------------------------------------------------


@dataclass
class ServerProc:
    base: Path
    port: int
    env: dict[str, str]
    log: Path
    model_dir: Path
    proc: subprocess.Popen | None = None
    # Where ``python -m omlx.cli`` runs: its omlx package wins (another commit's tree).
    cwd: Path = ROOT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "omlx.cli",
            "--base-path",
            str(self.base),
            "serve",
            "--model-dir",
            str(self.model_dir),
            "--port",
            str(self.port),
            "--no-install-default",
        ]
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=env, stderr=self.log.open("a"))
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                if self.proc.poll() is not None:
                    raise SystemExit(f"omlx serve exited: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.02)

    def stop(self) -> float:
        """SIGINT (as Ctrl-C) and wait; returns the seconds the shutdown took."""
        assert self.proc is not None
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        return time.perf_counter() - start


# -- requests ----------------------------------------------------------------


@dataclass
class Result:
    ttft_s: float
    text: str
    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int
    stamps: list[float] = field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        # Detokenized chunks can merge tokens; the rate uses the token count.
        return (self.completion_tokens - 1) / (self.stamps[-1] - self.stamps[0])


async def chat(
    http: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    ignore_eos: bool = False,
) -> Result:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stamps, text, usage = [], "", None
    start = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and (piece := chunk["choices"][0]["delta"].get("content")):
                stamps.append(time.perf_counter())
                text += piece
    assert usage is not None and stamps, "no content or no usage in the stream"
    return Result(
        stamps[0] - start,
        text,
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"],
        usage["completion_tokens"],
        stamps,
    )


async def cache_stats(http: httpx.AsyncClient) -> dict:
    return (await http.get("/admin/api/cache/stats")).json()


# -- phases ------------------------------------------------------------------


@dataclass
class Measured:
    cold: list[Result] = field(default_factory=list)
    ram: list[Result] = field(default_factory=list)
    ssd: list[Result] = field(default_factory=list)
    turn_cold: list[Result] = field(default_factory=list)
    turn_hit: list[Result] = field(default_factory=list)
    decode_on: list[float] = field(default_factory=list)
    decode_off: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


WARM_UP = [{"role": "user", "content": "Say hello."}]


async def ram_phase(args, on: ServerProc, off: ServerProc, convs, m: Measured) -> None:
    """Cold, RAM hit, then the next turn on the cache vs cold on the cache-off server."""
    async with (
        httpx.AsyncClient(base_url=on.url, timeout=600) as a,
        httpx.AsyncClient(base_url=off.url, timeout=600) as b,
    ):
        await chat(a, args.model, WARM_UP, 4)  # loads the model
        await chat(b, args.model, WARM_UP, 4)
        for messages in convs:
            cold = await chat(a, args.model, messages, args.answer_tokens)
            m.cold.append(cold)
            m.ram.append(await chat(a, args.model, messages, 8))
            turn = [
                *messages,
                {"role": "assistant", "content": cold.text},
                {"role": "user", "content": FOLLOW_UP},
            ]
            m.turn_cold.append(await chat(b, args.model, turn, 8))
            m.turn_hit.append(await chat(a, args.model, turn, 8))
        m.notes.append(f"cache stats before restart: {json.dumps(await cache_stats(a))}")


async def ssd_phase(args, on: ServerProc, convs, m: Measured) -> None:
    async with httpx.AsyncClient(base_url=on.url, timeout=600) as a:
        await chat(a, args.model, WARM_UP, 4)  # loads the model and opens the SSD store
        for messages in convs:
            m.ssd.append(await chat(a, args.model, messages, 8))
        stats = (await cache_stats(a))["models"].get(args.model, {})
        m.notes.append(f"SSD stats after the SSD hits: {json.dumps(stats.get('ssd'))}")


async def decode_phase(args, on: ServerProc, off: ServerProc, m: Measured) -> None:
    """Interleaved pairs, alternating which side goes first; distinct short prompts."""
    async with (
        httpx.AsyncClient(base_url=on.url, timeout=600) as a,
        httpx.AsyncClient(base_url=off.url, timeout=600) as b,
    ):
        for i in range(args.decode_repeats):
            prompt = [{"role": "user", "content": f"Tell me a long story about ship {i}."}]
            order = [(a, m.decode_on), (b, m.decode_off)]
            for http, out in order if i % 2 == 0 else order[::-1]:
                r = await chat(http, args.model, prompt, args.decode_tokens, ignore_eos=True)
                out.append(r.decode_tok_s)


# -- report ------------------------------------------------------------------


def med(results: list[Result]) -> float:
    return statistics.median(r.ttft_s for r in results)


def print_ttft(name: str, runs: list[Result], cold: list[Result] | None, target: float) -> None:
    """One TTFT row; with ``cold``, its ratio to that row's median and the target."""
    each = " ".join(f"{r.ttft_s:.3f}" for r in runs)
    if cold is None:
        print(f"{name:34} {med(runs):9.3f} {'':>7} {'':>8} {'':4}  {each}")
        return
    ratio = med(runs) / med(cold)
    flag = "ok" if ratio <= target else "MISS"
    print(f"{name:34} {med(runs):9.3f} {ratio:7.3f} {f'<= {target:.2f}':>8} {flag:4}  {each}")


def report(args, m: Measured) -> None:
    print(
        f"model {args.model}, prompt {m.cold[0].prompt_tokens} tokens, block {args.block_size}, "
        f"medians of {args.repeats} conversations / {args.decode_repeats} decode pairs, "
        f"python {sys.version.split()[0]}"
    )
    print(f"{'metric':34} {'value':>9} {'ratio':>7} {'target':>8}       runs")
    print_ttft("TTFT cold (s)", m.cold, None, 0)
    print_ttft("TTFT RAM hit (s)", m.ram, m.cold, 1 / 20)
    print_ttft("TTFT SSD hit after restart (s)", m.ssd, m.cold, 1 / 10)
    print_ttft("TTFT next turn, cache off (s)", m.turn_cold, None, 0)
    print_ttft("TTFT next turn, cache hit (s)", m.turn_hit, m.turn_cold, 1 / 5)
    on, off = statistics.median(m.decode_on), statistics.median(m.decode_off)
    flag = "ok" if abs(on / off - 1) <= 0.03 else "MISS"
    each = " ".join(f"{a / b:.3f}" for a, b in zip(m.decode_on, m.decode_off, strict=True))
    print(f"{'decode tok/s, cache off':34} {off:9.2f}")
    print(
        f"{'decode tok/s, cache on':34} {on:9.2f} {on / off:7.3f} {'1+-0.03':>8} {flag:4}  {each}"
    )
    print("cached_tokens, RAM hit:", *(r.cached_tokens for r in m.ram))
    print("cached_tokens, SSD hit:", *(r.cached_tokens for r in m.ssd))
    print(
        "cached_tokens, next turn:", *(f"{r.cached_tokens}/{r.prompt_tokens}" for r in m.turn_hit)
    )
    for note in m.notes:
        print(note)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, default=Path("~/.omlx/models").expanduser())
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="conversations per TTFT row")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--decode-repeats", type=int, default=4, help="on/off decode pairs")
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    if not (args.model_dir / args.model).exists():
        from omlx.models.builtin import install_default_model

        install_default_model(args.model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir / args.model)
    convs = [conversation(tokenizer, args.prompt_tokens, i) for i in range(args.repeats)]

    work = Path(tempfile.mkdtemp(prefix="omlx-bench-cache-"))
    block = {"OMLX_CACHE__BLOCK_SIZE": str(args.block_size)}
    on = ServerProc(work / "on", args.port, block, work / "on.log", args.model_dir)
    off = ServerProc(
        work / "off",
        args.port + 1,
        {"OMLX_CACHE__ENABLED": "false"},
        work / "off.log",
        args.model_dir,
    )
    m = Measured()
    on.start()
    off.start()
    try:
        asyncio.run(ram_phase(args, on, off, convs, m))
        stop_s = on.stop()
        files = list((work / "on" / "cache").rglob("*.safetensors"))
        size_mb = sum(f.stat().st_size for f in files) / 1e6
        m.notes.append(
            f"graceful stop {stop_s:.2f} s; SSD holds {len(files)} blocks, {size_mb:.0f} MB"
        )
        on.start()
        asyncio.run(ssd_phase(args, on, convs, m))
        asyncio.run(decode_phase(args, on, off, m))
    finally:
        for server in (on, off):
            if server.proc is not None:
                server.stop()
    report(args, m)
    print(f"server logs: {work}")


if __name__ == "__main__":
    main()
