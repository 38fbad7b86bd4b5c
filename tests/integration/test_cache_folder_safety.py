"""`omlx serve` keeps its KV cache away from everything that is not its own.

A real server on a tiny model, with write-through and 16-token blocks so every
prompt writes block files. The attacks: a cache folder set to (or around) the
models folder, foreign files dropped into the cache folder, two model names that
used to share one folder, and other users reading prompts' KV blocks or logs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.cache.location import SSD_ROOT_NAME, model_folder_name
from omlx.cache.ssd import BLOCK_SUFFIX, MARKER_NAME
from tests.fixtures.servers import ROOT, free_port, serve_process
from tests.fixtures.tiny_models import CORPUS

WRITE_THROUGH = {"cache": {"hot_cache_mode": "write-through", "block_size": 16}}
PROMPT = CORPUS.read_text(encoding="utf-8")[:2000]


def files_of(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def make_base(path: Path, settings: dict) -> Path:
    path.mkdir(parents=True)
    (path / "settings.json").write_text(json.dumps(settings))
    return path


def block_files(folder: Path) -> list[Path]:
    """The KV blocks omlx wrote in ``folder`` (hex key + .safetensors)."""
    found = folder.glob(f"*{BLOCK_SUFFIX}") if folder.is_dir() else []
    return sorted(p for p in found if re.fullmatch(r"[0-9a-f]+", p.stem))


def complete(url: str, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()


def wait_until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def settle(folder: Path, quiet_s: float = 0.5) -> None:
    """Wait until no block file came or went for ``quiet_s``: the stores a finished
    request defers to the engine's next step are on disk."""
    seen, since = block_files(folder), time.monotonic()
    deadline = since + 20
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = block_files(folder)
        if now != seen:
            seen, since = now, time.monotonic()


@pytest.fixture
def models(tiny_models_dir: Path, tmp_path: Path) -> Path:
    """A private copy of tiny-llama: whatever happens, the session's models are safe."""
    root = tmp_path / "models"
    shutil.copytree(tiny_models_dir / "tiny-llama", root / "tiny-llama")
    return root


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The common default umask: group and others could read what it creates."""
    old = os.umask(0o022)
    yield
    os.umask(old)


# -- a cache folder overlapping the models is refused -------------------------------


@pytest.mark.parametrize(
    ("cache", "relation"),
    [
        ("models", "is the model folder"),
        ("models/tiny-llama", "is inside the model folder"),
        (".", "contains the model folder"),
    ],
)
def test_cache_folder_overlapping_models_is_refused_at_start(
    models: Path, tmp_path: Path, cache: str, relation: str
) -> None:
    before = files_of(models)
    cmd = [sys.executable, "-m", "omlx.cli", "--base-path", str(tmp_path / "base"), "serve"]
    cmd += ["--model-dir", str(models), "--port", str(free_port()), "--no-install-default"]
    cmd += ["--cache-dir", str(tmp_path / cache)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("omlx serve started with a cache folder overlapping the models")
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert f"cache.ssd_cache_dir {tmp_path / cache} {relation} {models}" in err
    assert files_of(models) == before
    assert not (models / "tiny-llama" / MARKER_NAME).exists()


# -- foreign files in the cache folder --------------------------------------------


def plant(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def test_foreign_files_survive_restarts_and_an_ssd_clear(models: Path, tmp_path: Path) -> None:
    base = make_base(tmp_path / "base", WRITE_THROUGH)
    cache = base / "cache"
    ours = cache / SSD_ROOT_NAME / model_folder_name("tiny-llama")
    weights = (models / "tiny-llama" / "model.safetensors").read_bytes()
    # In the cache folder before omlx ever ran: a real weights file, a file named
    # like a block, another file, and an older omlx's layout (<cache>/<model>/).
    beside = {
        "weights.safetensors": weights,
        "0123456789abcdef.safetensors": b"named like a block, outside omlx's folder",
        "readme.txt": b"my notes",
        "tiny-llama/00000000deadbeef.safetensors": b"an older omlx's block",
    }
    plant(cache, beside)
    log = tmp_path / "server.log"
    with log.open("a") as err, serve_process(base, models, stderr=err) as (_, url):
        complete(url, "tiny-llama")
        assert wait_until(lambda: len(block_files(ours)) > 3)

    # Inside omlx's own folder: a foreign weights file and notes survive; a block
    # of ours damaged (as by a crash) is removed at the next start.
    inside = {"weights.safetensors": weights, "notes.txt": b"mine"}
    plant(ours, inside)
    damaged = block_files(ours)[0]
    damaged.write_bytes(damaged.read_bytes()[:40])
    with log.open("a") as err, serve_process(base, models, stderr=err) as (_, url):
        complete(url, "tiny-llama")  # loads the model, which opens and checks the store
        settle(ours)
        cleared = httpx.post(url + "/admin/api/cache/clear", json={"tier": "ssd"}, timeout=30)
        assert cleared.status_code == 200, cleared.text
        assert block_files(ours) == []

    assert files_of(cache) == {
        **beside,
        **{f"{SSD_ROOT_NAME}/{ours.name}/{name}": data for name, data in inside.items()},
        f"{SSD_ROOT_NAME}/{ours.name}/{MARKER_NAME}": (ours / MARKER_NAME).read_bytes(),
    }
    text = log.read_text()
    assert f"SSD cache: removing {damaged.name}" in text
    assert f"{cache / 'tiny-llama'} hold(s) blocks from an older omlx layout" in text


def test_model_names_that_used_to_collide_keep_separate_caches(
    tiny_models_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    for name in ("a/b", "a_b"):
        shutil.copytree(tiny_models_dir / "tiny-llama", models / name)
    base = make_base(tmp_path / "base", WRITE_THROUGH)
    root = base / "cache" / SSD_ROOT_NAME
    first, second = root / model_folder_name("a/b"), root / model_folder_name("a_b")
    assert first != second
    with serve_process(base, models, stderr=subprocess.DEVNULL) as (_, url):
        complete(url, "a/b")
        assert wait_until(lambda: len(block_files(first)) > 3)
        settle(first)
        written = block_files(first)
        complete(url, "a_b")  # opening its store once deleted a/b's blocks as foreign
        assert wait_until(lambda: len(block_files(second)) > 3)
        assert block_files(first) == written


# -- private files -----------------------------------------------------------------


def omlx_config_set(base: Path, key: str, value: str) -> None:
    cmd = [sys.executable, "-m", "omlx.cli", "--base-path", str(base), "config", "set", key, value]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=60)


def test_what_omlx_writes_is_private_to_the_user(
    models: Path, tmp_path: Path, loose_umask: None
) -> None:
    base = tmp_path / "base"
    base.mkdir(mode=0o755)  # made by an older omlx, readable by every user
    base.chmod(0o755)
    omlx_config_set(base, "cache.hot_cache_mode", "write-through")
    omlx_config_set(base, "cache.block_size", "16")
    kv = tmp_path / "kv" / "nested"  # created by omlx, parents included
    with serve_process(base, models, "--cache-dir", str(kv)) as (_, url):
        complete(url, "tiny-llama")
        ours = kv / SSD_ROOT_NAME / model_folder_name("tiny-llama")
        assert wait_until(lambda: len(block_files(ours)) > 3)
    folders = [base, base / "logs", tmp_path / "kv", kv, kv / SSD_ROOT_NAME, ours]
    files = [base / "settings.json", base / "logs" / "server.log", ours / MARKER_NAME]
    files += block_files(ours)
    assert {str(p): oct(mode(p)) for p in folders} == {str(p): "0o700" for p in folders}
    assert {str(p): oct(mode(p)) for p in files} == {str(p): "0o600" for p in files}
