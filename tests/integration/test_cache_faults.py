"""The SSD tier of the prefix cache survives a killed server and damaged files.

A real ``omlx serve`` on tiny-llama with write-through and 16-token blocks, so
every prompt turns into many block files written while requests still run.
Whatever the disk holds afterwards, a restarted server must give the same
greedy text as a server that never had a cache: no broken block is served.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from omlx.cache import safetensors_io
from omlx.cache.location import SSD_ROOT_NAME, model_folder_name
from omlx.cache.ssd import BLOCK_SUFFIX, TEMP_SUFFIX
from tests.fixtures.servers import serve_process
from tests.fixtures.tiny_models import CORPUS

MODEL = "tiny-llama"
WRITE_THROUGH = {"cache": {"hot_cache_mode": "write-through", "block_size": 16}}
NO_CACHE = {"cache": {"enabled": False}}
NUM_PROMPTS = 4
# Block files on disk when each round's SIGKILL lands: early, mid-stream, late.
KILL_AFTER_FILES = (1, 40, 150)


def prompts(round_: int) -> list[str]:
    """Long prompts that differ from their first token (no shared blocks)."""
    text = CORPUS.read_text(encoding="utf-8")
    return [f"Round {round_}, session {i}.\n" + text * 2 for i in range(NUM_PROMPTS)]


def make_base(path: Path, settings: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "settings.json").write_text(json.dumps(settings))
    return path


def block_dir(base: Path) -> Path:
    # EnginePool puts a model's blocks in <cache_dir>/omlx-kv-v1/<model folder>.
    return base / "cache" / SSD_ROOT_NAME / model_folder_name(MODEL)


def block_files(base: Path) -> list[Path]:
    folder = block_dir(base)
    return sorted(folder.glob(f"*{BLOCK_SUFFIX}")) if folder.is_dir() else []


def temp_files(base: Path) -> list[Path]:
    folder = block_dir(base)
    return sorted(folder.glob(f"*{TEMP_SUFFIX}")) if folder.is_dir() else []


def unreadable(files: list[Path]) -> list[str]:
    """Names of the files that fail a full read (header, lengths and checksum)."""
    bad = []
    for path in files:
        try:
            with open(path, "rb") as f:
                safetensors_io.read(f, path.stat().st_size)
        except FileNotFoundError:
            continue
        except safetensors_io.SafetensorsFormatError:
            bad.append(path.name)
    return bad


def complete(url: str, prompt: str, max_tokens: int = 16) -> tuple[str, int]:
    """(text, cached prompt tokens) of one greedy completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    resp.raise_for_status()
    out = resp.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture(scope="module")
def cold_texts(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each prompt's greedy text from a server without a prefix cache."""
    base = make_base(tmp_path_factory.mktemp("cold"), NO_CACHE)
    every = [p for r in range(len(KILL_AFTER_FILES)) for p in prompts(r)]
    with serve_process(base, tiny_models_dir, stderr=subprocess.DEVNULL) as (_, url):
        return {p: complete(url, p)[0] for p in every}


def kill_during_writes(base: Path, model_dir: Path, round_: int, log: Path) -> bool:
    """Start concurrent long requests; SIGKILL once the round's quota of new blocks
    is on disk (the writer is then mid-stream: there are hundreds to write).
    Returns whether the kill left a half-written temp file behind."""
    target = len(block_files(base)) + KILL_AFTER_FILES[round_]
    with (
        log.open("a") as err,
        serve_process(base, model_dir, stderr=err) as (proc, url),
        ThreadPoolExecutor(NUM_PROMPTS) as pool,
    ):
        for prompt in prompts(round_):
            pool.submit(complete, url, prompt, 200)  # fails when the server dies
        assert wait_until(lambda: len(block_files(base)) >= target)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return bool(temp_files(base))


def test_sigkill_during_cache_writes_serves_no_corrupt_block(
    tiny_models_dir: Path, tmp_path: Path, cold_texts: dict[str, str]
) -> None:
    base = make_base(tmp_path / "base", WRITE_THROUGH)
    log = tmp_path / "server.log"
    left_temp = []
    for round_ in range(len(KILL_AFTER_FILES)):
        left_temp.append(kill_during_writes(base, tiny_models_dir, round_, log))
        with log.open("a") as err, serve_process(base, tiny_models_dir, stderr=err) as (_, url):
            # The first request loads the model, which opens (and checks) the store.
            warm = [complete(url, p) for p in prompts(round_)]
            assert [text for text, _ in warm] == [cold_texts[p] for p in prompts(round_)]
            assert any(cached > 0 for _, cached in warm), "nothing was served from the SSD"
            assert wait_until(lambda: not temp_files(base))
            assert unreadable(block_files(base)) == []
    # Otherwise no kill hit a write and the temp-file checks proved nothing.
    assert any(left_temp), "no SIGKILL landed inside a block write"


def by_write_order(files: list[Path]) -> list[Path]:
    # One prompt's blocks are written in chain order by the single writer thread.
    return sorted(files, key=lambda path: path.stat().st_mtime_ns)


def test_damaged_block_files_are_never_served(
    tiny_models_dir: Path, tmp_path: Path, cold_texts: dict[str, str]
) -> None:
    base = make_base(tmp_path / "base", WRITE_THROUGH)
    log = tmp_path / "server.log"
    prompt = prompts(0)[0]
    with log.open("a") as err, serve_process(base, tiny_models_dir, stderr=err) as (_, url):
        assert complete(url, prompt) == (cold_texts[prompt], 0)
        assert wait_until(lambda: len(block_files(base)) > 20 and not temp_files(base))
    chain = by_write_order(block_files(base))
    flipped, truncated, garbage = chain[0], [chain[1], chain[10]], [chain[2], chain[11]]
    # Header intact, so only the checksum on read can catch it; it is the first
    # block of the chain, so the next lookup must read it.
    raw = flipped.read_bytes()
    flipped.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    for path in truncated:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for path in garbage:
        path.write_bytes(b"\x93not a safetensors file" * 64)

    with log.open("a") as err, serve_process(base, tiny_models_dir, stderr=err) as (_, url):
        assert complete(url, prompt) == (cold_texts[prompt], 0)
        assert wait_until(lambda: not temp_files(base))
        # The damaged blocks were written again: now the whole prompt hits.
        text, cached = complete(url, prompt)
        assert text == cold_texts[prompt] and cached > 20 * 16
        assert unreadable(block_files(base)) == []
    text = log.read_text()
    for path in truncated + garbage:
        assert f"SSD cache: removing {path.name}" in text  # at start, from the header
    assert f"SSD cache: skipping unreadable block {flipped.stem}" in text
