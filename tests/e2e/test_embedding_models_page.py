"""The Models page installs the built-in embedding model and shows each model's kind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from omlx.embeddings.builtin import BUILTIN_EMBEDDING_NAME
from tests.e2e.conftest import open_page, screenshot
from tests.fixtures.servers import serve_process


@pytest.fixture(scope="module")
def url(e2e_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # A model dir of its own: the install lands here, not in the shared e2e models.
    root = tmp_path_factory.mktemp("e2e-embedding-models")
    (root / "tiny-llama").symlink_to(e2e_models_dir / "tiny-llama")
    with serve_process(tmp_path_factory.mktemp("e2e-embedding-base"), root) as (_, base_url):
        yield base_url


def test_install_embedding_model_and_see_kinds(browser, url: str) -> None:
    context, page, problems = open_page(browser, url)
    try:
        page.goto(f"{url}/admin/#/models")
        llm = page.locator('tr[data-model="tiny-llama"]')
        expect(llm.locator('[data-col="kind"]')).to_have_text("llm")
        page.locator('[data-action="install-embedding"]').click()
        row = page.locator(f'tr[data-model="{BUILTIN_EMBEDDING_NAME}"]')
        expect(row.locator('[data-col="kind"]')).to_have_text("embedding")
        # Embedding models do not chat; they load and pin like any model.
        expect(row.locator("button", has_text="Chat")).to_have_count(0)
        expect(llm.locator("button", has_text="Chat")).to_have_count(1)
        row.locator('[data-action="load"]').click()
        expect(row).to_have_attribute("data-state", "loaded")
        screenshot(page, "models-embedding")
        reply = httpx.post(
            url + "/v1/embeddings", json={"model": BUILTIN_EMBEDDING_NAME, "input": "hi"}
        )
        assert len(reply.json()["data"][0]["embedding"]) == 384
        # The Chat page offers chat models only.
        page.goto(f"{url}/admin/#/chat")
        options = page.locator('select[name="model"] option')
        expect(options).to_have_count(1)
        expect(options).to_have_text(["tiny-llama"])
    finally:
        context.close()
    problems.check()
