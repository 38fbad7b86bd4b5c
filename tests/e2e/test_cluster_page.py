"""The admin panel's Cluster page in Chromium: the ranks of a model split across two
processes (each with its memory), the one-process notice, and on `omlx router` the
Backends page."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx.router.config import BackendSpec, RouterConfig
from omlx.router.server import RouterServer
from tests.distributed.ranks import launched
from tests.e2e.conftest import open_page, screenshot
from tests.fixtures.servers import free_port


def test_cluster_page_lists_each_rank_with_its_memory(
    browser, e2e_models_dir: Path, tmp_path: Path
) -> None:
    with launched(tmp_path, e2e_models_dir, "tiny-llama", "tensor") as url:
        context, page, problems = open_page(browser, url)
        page.goto(url + "/admin/#/cluster")
        card = page.locator("#cluster-ranks")
        card.locator('tr[data-rank="1"] td.memory', has_text=" of ").wait_for()
        assert "tiny-llama · tensor parallel over 2 ranks" in card.inner_text()
        rows = card.locator("tbody tr")
        assert rows.count() == 2
        assert rows.nth(0).locator("[data-state]").inner_text() == "serving"
        assert rows.nth(1).locator("[data-state]").inner_text() == "following"
        assert "%" in rows.nth(0).locator("td.memory").inner_text()
        screenshot(page, "cluster-ranks")
        context.close()
        problems.check()


def test_cluster_page_on_a_one_process_server_says_so(page, admin_url: str) -> None:
    page.goto(admin_url + "/admin/#/cluster")
    assert "runs its models in one process" in page.locator("#cluster-single").inner_text()


@pytest.fixture
def router_url(admin_url: str):
    dead = f"http://127.0.0.1:{free_port()}"
    config = RouterConfig(
        backends=(BackendSpec(admin_url), BackendSpec(dead)), port=free_port(), poll_interval_s=0.3
    )
    router = RouterServer(config)
    router.start_in_thread()
    yield f"http://127.0.0.1:{config.port}", dead
    router.stop()


def test_router_panel_shows_its_backends(browser, admin_url: str, router_url) -> None:
    url, dead = router_url
    context, page, problems = open_page(browser, url)
    page.goto(url + "/admin/")
    card = page.locator("#router-backends")
    card.locator(f'tr[data-backend="{dead}"] [data-state="down"]').wait_for()
    card.locator(f'tr[data-backend="{admin_url}"] [data-state="healthy"]').wait_for()
    assert [a.inner_text() for a in page.locator("#nav a").all()] == ["Backends"]
    assert "1 of 2 healthy" in card.inner_text()
    assert "tiny-llama" in card.locator(f'tr[data-backend="{admin_url}"]').inner_text()
    assert "router · 1/2 up" in page.locator("#server-pill").inner_text()
    screenshot(page, "router-backends")
    context.close()
    problems.check()
