"""Load and soak: many concurrent greedy clients against a real ``omlx serve``.

Every answer must equal the same request's answer when it ran alone (a stream
cut short or mixed with another request's tokens cannot), no response may be a
5xx, the server's RSS must not grow between the first and the last window of
the run, and once the clients stop nothing may stay in flight or hold KV memory.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.fixtures.servers import serve_process
from tests.reliability.clients import (
    Answer,
    BadAnswer,
    Job,
    RssSampler,
    ask,
    finish_counts,
    jobs,
    kv_returned,
    mlx_active_bytes,
    wait_idle,
)
from tests.reliability.conftest import Profile

NUM_JOBS = 16


@dataclass
class LoadResult:
    statuses: Counter[int] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)  # truncated, mixed up or malformed
    transport_errors: list[str] = field(default_factory=list)

    @property
    def num_ok(self) -> int:
        return self.statuses[200] - len(self.wrong)


async def _solo(url: str, work: list[Job]) -> list[Answer]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        answers = []
        for job in work:
            status, answer = await ask(client, job)
            assert status == 200 and answer is not None
            answers.append(answer)
        return answers


async def _hammer(
    url: str, work: list[Job], solo: list[Answer], clients: int, duration_s: float
) -> LoadResult:
    result = LoadResult()
    deadline = time.monotonic() + duration_s
    # A new connection per request: a keep-alive connection closed by the server while
    # idle is a race every HTTP/1.1 client must retry, and would hide a real fault.
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def client_loop(n: int) -> None:
            turn = n
            while time.monotonic() < deadline:
                index = turn % len(work)
                turn += 1
                try:
                    status, answer = await ask(client, work[index])
                except BadAnswer as exc:
                    result.statuses[200] += 1
                    result.wrong.append(f"job {index}: {exc}")
                    continue
                except httpx.HTTPError as exc:
                    result.transport_errors.append(f"job {index}: {exc!r}")
                    continue
                result.statuses[status] += 1
                if answer is not None and answer != solo[index]:
                    result.wrong.append(f"job {index}: {answer} != solo {solo[index]}")

        await asyncio.gather(*(client_loop(n) for n in range(clients)))
    return result


def test_concurrent_clients_get_their_solo_answers_and_leave_nothing_behind(
    tiny_models_dir: Path, tmp_path: Path, profile: Profile
) -> None:
    log = tmp_path / "server.log"
    flags = ("--max-concurrent-requests", "16")
    with (
        log.open("w") as err,
        serve_process(tmp_path / "base", tiny_models_dir, *flags, stderr=err) as (proc, url),
    ):
        work = jobs(NUM_JOBS)
        # Both endpoints, streamed and not, so every response path is under load.
        assert len({(j.chat, j.stream) for j in work}) == 4
        solo = asyncio.run(_solo(url, work))
        # Otherwise a mixed-up stream could go unnoticed.
        assert len({a.text for a in solo}) == NUM_JOBS
        wait_idle(url)
        idle_mlx_bytes = mlx_active_bytes(url)
        finished_before = finish_counts(url)

        sampler = RssSampler(proc.pid)
        start = time.monotonic()
        result = asyncio.run(_hammer(url, work, solo, profile.clients, profile.load_s))
        end = time.monotonic()
        sampler.stop()

        wait_idle(url)
        finished = Counter(finish_counts(url))
        finished.subtract(finished_before)
        after_mlx_bytes = kv_returned(url, idle_mlx_bytes)

    window = profile.rss_window_s
    first = sampler.window_mean(start + window, start + 2 * window)  # after a warm-up
    last = sampler.window_mean(end - window, end)
    growth = (last - first) / first
    print(
        f"\nload ({profile.name}): {result.num_ok} answers from {profile.clients} clients in "
        f"{end - start:.0f} s, statuses {dict(result.statuses)}, "
        f"{len(result.transport_errors)} transport errors, engine finishes {dict(finished)}; "
        f"RSS {first / 2**20:.0f} -> {last / 2**20:.0f} MiB ({growth:+.1%}); "
        f"MLX active idle {idle_mlx_bytes / 2**20:.2f} MiB, after {after_mlx_bytes / 2**20:.2f} MiB"
    )
    server_log = log.read_text()
    problems = [
        line for line in server_log.splitlines() if " WARNING " in line or " ERROR " in line
    ]
    assert result.transport_errors == [], problems[-20:]
    assert result.wrong == []
    assert {s for s in result.statuses if s >= 500} == set()
    assert set(result.statuses) == {200}
    # Enough traffic that the checks mean something: several requests per client.
    assert result.num_ok >= 4 * profile.clients
    # Every request the clients saw finished normally in the engine, none was lost.
    assert finished["stop"] + finished["length"] == result.num_ok
    assert finished["abort"] == finished["error"] == finished["rejected"] == 0
    # KV caches are MLX arrays: all of them went back (the prefix cache keeps bytes).
    assert after_mlx_bytes <= idle_mlx_bytes * 1.01 + (1 << 20)
    assert growth < profile.rss_growth_max
    assert "Traceback" not in server_log
