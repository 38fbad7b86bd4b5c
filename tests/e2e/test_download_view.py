"""The admin panel's Download view in a real browser, against ``omlx serve`` whose Hub
is a local fake speaking the Hub's HTTP API (the real huggingface_hub is the client)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import open_page, screenshot
from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.servers import free_port, serve_process
from tests.fixtures.tiny_models import build_tiny_model

TINY = "mlx-community/tiny-llama-4bit"
SLOW = "mlx-community/wide-llama-8bit"
LONG = "mlx-community/long-context-8bit"
HUGE = "mlx-community/huge-model-bf16"
GATED = "meta-llama/gated-llama-mlx"
GGUF_ONLY = "someone/tiny-llama-GGUF"
REAL_GGUF = "someone/tiny-qwen3-GGUF"
REAL_GGUF_FILE = "tiny-qwen3.Q4_K_M.gguf"
NOT_MLX = "someone/pytorch-only"
# An 80-layer, 8-KV-head bf16 model: 327,680 B of KV per token.
LONG_CONFIG = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def header_only_safetensors(parameters: int) -> bytes:
    """A safetensors header declaring ``parameters`` bf16 weights (the Hub's search
    summary reads the header only): a 10 GB model in a few bytes."""
    header = json.dumps({"w": {"dtype": "BF16", "shape": [parameters], "data_offsets": [0, 0]}})
    return struct.pack("<Q", len(header)) + header.encode()


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def write_real_gguf(root: Path) -> bytes:
    """A real Q4_K_M GGUF of a tiny Qwen 3 (llama.cpp's mix), which the import accepts."""
    from gguf import GGMLQuantizationType as Q

    from tests.fixtures.gguf_files import write_model_gguf

    mix = {".v_proj": Q.Q6_K, "down_proj": Q.Q6_K, "lm_head": Q.Q6_K, "default": Q.Q4_K}
    source = build_tiny_model(root / "qwen3", "gguf-qwen3")
    write_model_gguf(source, root / REAL_GGUF_FILE, mix)
    return (root / REAL_GGUF_FILE).read_bytes()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    root = tmp_path_factory.mktemp("hub-src")
    tiny = folder_files(build_tiny_model(root / "tiny", "llama", seed=3))
    wide = folder_files(build_tiny_model(root / "wide", "llama", seed=4, hidden_size=1024))
    real_gguf = write_real_gguf(root)
    with FakeHub() as fake:
        fake.add_repo(TINY, tiny, downloads=900, likes=12)
        fake.add_repo(SLOW, wide, downloads=800)
        fake.add_repo(
            LONG,
            {**tiny, "config.json": json.dumps(LONG_CONFIG).encode()},
            downloads=700,
        )
        huge = {"config.json": json.dumps(LONG_CONFIG).encode()}
        fake.add_repo(
            HUGE, {**huge, "model.safetensors": header_only_safetensors(5 * 10**9)}, downloads=600
        )
        fake.add_repo(GATED, tiny, gated=True, downloads=500)
        fake.add_repo(
            GGUF_ONLY,
            {"tiny-llama.Q4_0.gguf": b"GGUF" + bytes(4096), "README.md": b"hi"},
            tags=["gguf"],
        )
        fake.add_repo(REAL_GGUF, {REAL_GGUF_FILE: real_gguf, "README.md": b"hi"}, tags=["gguf"])
        fake.add_repo(
            NOT_MLX,
            {"config.json": tiny["config.json"], "pytorch_model.bin": b"0" * 64},
            tags=["pytorch"],
        )
        yield fake


def hub_env(endpoint: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(home)}


@pytest.fixture(scope="module")
def download_server(
    hub: FakeHub, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    models = tmp_path_factory.mktemp("dl-models")
    build_tiny_model(models / "already-here", "llama", seed=5)
    base = tmp_path_factory.mktemp("dl-base")
    env = hub_env(hub.url, tmp_path_factory.mktemp("hf-home"))
    with serve_process(base, models, "--max-process-memory", "4GB", env=env) as (_, url):
        yield url, models


@pytest.fixture
def download_page(browser, download_server: tuple[str, Path]) -> Iterator:
    context, page, problems = open_page(browser, download_server[0])
    page.goto(f"{download_server[0]}/admin/#/download")
    page.wait_for_selector("#hub-query")
    yield page
    context.close()
    problems.check()


def search(page, text: str) -> None:
    page.fill("#hub-query", text)
    page.click("#hub-search")


def inspect(page, repo_id: str) -> None:
    page.fill("#hub-query", repo_id)
    page.click("#hub-inspect")


def test_search_shows_size_quantization_and_fit_verdicts(download_page) -> None:
    page = download_page
    search(page, "mlx-community")
    rows = page.locator("#hub-results tr[data-repo]")
    expect(rows).to_have_count(4)
    # Most downloaded first, as the Hub sorts them.
    assert rows.first.get_attribute("data-repo") == TINY
    tiny = page.locator(f'#hub-results tr[data-repo="{TINY}"]')
    expect(tiny.locator(".badge.fit")).to_have_attribute("data-verdict", "fits")
    expect(tiny).to_contain_text("4bit")
    expect(tiny).to_contain_text(" KB")  # a size, in the server's units
    long = page.locator(f'#hub-results tr[data-repo="{LONG}"] .badge.fit')
    expect(long).to_have_attribute("data-verdict", "fits_shorter_context")
    expect(long).to_contain_text("fits with a shorter context:")
    huge = page.locator(f'#hub-results tr[data-repo="{HUGE}"] .badge.fit')
    expect(huge).to_have_attribute("data-verdict", "does_not_fit")
    expect(huge).to_contain_text("does not fit: needs")
    expect(huge).to_contain_text("limit 4 GB")
    screenshot(page, "download-search")


def test_download_runs_to_done_and_the_model_is_listed(
    download_page, download_server: tuple[str, Path]
) -> None:
    page = download_page
    url, models = download_server
    inspect(page, TINY)
    card = page.locator(f'#hub-inspection [data-repo="{TINY}"]')
    expect(card).to_have_attribute("data-kind", "mlx")
    expect(card).to_contain_text("config.json")
    expect(card.locator(".badge.fit")).to_have_attribute("data-verdict", "fits")
    expect(card).to_contain_text("Disk free")
    screenshot(page, "download-inspect")
    card.locator('input[name="name"]').fill("tiny-from-hub")
    card.locator("#download-start").click()
    task = page.locator("#downloads [data-download]").filter(has_text="tiny-from-hub")
    expect(task).to_have_attribute("data-phase", "done", timeout=60_000)
    expect(task.locator(".progress > div")).to_have_attribute("style", "width: 100%;")
    assert (models / "tiny-from-hub" / "config.json").is_file()
    names = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert "tiny-from-hub" in names
    task.locator('[data-action="open-model"]').click()
    expect(page.locator('tr[data-model="tiny-from-hub"]')).to_be_visible()
    screenshot(page, "download-done-models")


def test_a_running_download_shows_progress_and_cancels(
    download_page, hub: FakeHub, download_server: tuple[str, Path]
) -> None:
    page = download_page
    # ~36 MB: huggingface_hub writes a file in 10 MiB pieces. The first 12 MB come at
    # once, so the bar moves at once; the rest at 2 MB/s would need ~12 s more: time
    # to watch and cancel.
    hub.bytes_per_s, hub.unthrottled_bytes = 2_000_000, 12_000_000
    try:
        search(page, "wide-llama")
        page.locator(f'tr[data-repo="{SLOW}"] [data-action="download"]').click()
        task = page.locator("#downloads [data-download]").filter(has_text=SLOW)
        expect(task).to_have_attribute("data-phase", "downloading", timeout=30_000)
        expect(task.locator(".bytes")).to_contain_text("/s", timeout=30_000)  # speed shown
        bar = task.locator(".progress")
        expect(bar).not_to_have_attribute("aria-valuenow", "0", timeout=30_000)  # bytes arrive
        screenshot(page, "download-running")
        task.locator('[data-action="cancel"]').click()
        expect(task).to_have_attribute("data-phase", "cancelled", timeout=30_000)
    finally:
        hub.bytes_per_s, hub.unthrottled_bytes = None, 0
    names = [m["id"] for m in httpx.get(download_server[0] + "/v1/models").json()["data"]]
    assert not any("wide-llama" in n for n in names)
    task.locator('[data-action="delete"]').click()
    expect(task).to_have_count(0)


@pytest.mark.parametrize(
    ("repo_id", "words", "link"),
    [
        (GATED, "gated", "models.hf_token"),
        (NOT_MLX, "not an MLX model", None),
        ("mlx-community/no-such-repo", "no model repo", None),
    ],
)
def test_errors_are_shown_in_words(download_page, repo_id: str, words: str, link: str | None):
    page = download_page
    inspect(page, repo_id)
    notice = page.locator("#hub-status .notice.err")
    expect(notice).to_contain_text(words)
    if link:
        expect(notice.locator(f'a[data-setting="{link}"]')).to_be_visible()
        screenshot(page, "download-error-token")


def test_a_gguf_only_repo_offers_its_files_for_import(download_page) -> None:
    page = download_page
    inspect(page, GGUF_ONLY)
    card = page.locator(f'#hub-inspection [data-repo="{GGUF_ONLY}"]')
    expect(card).to_have_attribute("data-kind", "gguf")
    expect(card.locator('[data-gguf="tiny-llama.Q4_0.gguf"]')).to_be_visible()
    card.locator('input[name="path"]').fill("/no/such/file.gguf")
    card.locator('[data-action="import-gguf"]').click()
    expect(card.locator('[data-field="path"] .error')).to_contain_text("file.gguf")


def test_download_and_import_of_a_gguf_runs_to_a_listed_model(
    download_page, download_server: tuple[str, Path]
) -> None:
    page = download_page
    url, models = download_server
    inspect(page, REAL_GGUF)
    card = page.locator(f'#hub-inspection [data-repo="{REAL_GGUF}"]')
    expect(card).to_have_attribute("data-kind", "gguf")
    card.locator('select[name="dtype"]').select_option("keep")
    row = card.locator(f'[data-gguf="{REAL_GGUF_FILE}"]')
    row.locator('[data-action="download-gguf"]').click()
    task = page.locator("#downloads [data-download]").filter(has_text=REAL_GGUF_FILE)
    expect(task).to_have_attribute("data-phase", "done", timeout=180_000)
    expect(task.locator("details.conversion")).to_contain_text("Imported as qwen3 (keep)")
    expect(task.locator("details.conversion")).to_contain_text("the GGUF was removed")
    screenshot(page, "download-gguf-imported")
    name = "tiny-qwen3.Q4_K_M"
    assert (models / name / "config.json").is_file()
    assert not list(models.rglob("*.gguf"))
    assert name in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    task.locator('[data-action="open-model"]').click()
    expect(page.locator(f'tr[data-model="{name}"]')).to_be_visible()


def test_an_unreachable_hub_says_offline_and_where_to_set_a_mirror(
    browser, tmp_path: Path, e2e_models_dir: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = hub_env(dead, tmp_path / "hf-home")
    with serve_process(tmp_path / "base", e2e_models_dir, env=env) as (_, url):
        context, page, problems = open_page(browser, url)
        page.goto(f"{url}/admin/#/download")
        search(page, "qwen")
        notice = page.locator("#hub-status .notice.err")
        # huggingface_hub retries a refused connection with backoff (~23 s) first.
        expect(notice).to_contain_text("offline?", timeout=60_000)
        expect(notice.locator('a[data-setting="models.hf_endpoint"]')).to_be_visible()
        context.close()
    # A 502 from the Hub route is the message, not a server fault.
    problems.server_errors = [e for e in problems.server_errors if not e.startswith("502 ")]
    problems.check()
