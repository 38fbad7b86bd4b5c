"""The Chat page attaches images (file picker or paste) for vision models: sent as
OpenAI image_url data URL parts, shown in the conversation, answered by a tiny VLM."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image
from playwright.sync_api import expect

from tests.e2e.conftest import open_page, screenshot
from tests.fixtures.servers import serve_process
from tests.fixtures.tiny_vlms import build_tiny_vlm


def png(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40, 30), (shade, 255 - shade, 90)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def url(e2e_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("e2e-chat-images")
    (root / "tiny-llama").symlink_to(e2e_models_dir / "tiny-llama")
    build_tiny_vlm(root / "tiny-llava", "llava", seed=0)
    with serve_process(tmp_path_factory.mktemp("e2e-chat-images-base"), root) as (_, base_url):
        yield base_url


def test_an_attached_image_is_sent_shown_and_answered(browser, url: str) -> None:
    context, page, problems = open_page(browser, url)
    try:
        page.goto(f"{url}/admin/#/chat?model=tiny-llama")
        attach = page.locator("#chat-attach")
        expect(attach).to_be_disabled()  # a text model takes no images
        page.select_option('select[name="model"]', "tiny-llava")
        expect(attach).to_be_enabled()
        image = png(40)
        page.set_input_files(
            "#chat-image-file",
            files=[{"name": "cat.png", "mimeType": "image/png", "buffer": image}],
        )
        thumbs = page.locator("#chat-attachments img")
        expect(thumbs).to_have_count(1)
        page.locator('input[name="max_tokens"]').fill("4")
        page.locator('input[name="temperature"]').fill("0")
        page.fill("#chat-input", "what is in the picture?")
        with page.expect_request("**/v1/chat/completions") as sent:
            page.click("#chat-send")
        reply = page.locator('.msg[data-role="assistant"][data-done]')
        expect(reply).to_have_count(1, timeout=60_000)
        expect(reply.locator(".meta")).to_contain_text("tokens")
        assert "error" not in (reply.get_attribute("class") or "")
        # The message went as image_url then text, the image as the file's data URL.
        content = json.loads(sent.value.post_data)["messages"][0]["content"]
        data_url = "data:image/png;base64," + base64.b64encode(image).decode()
        assert content == [
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": "what is in the picture?"},
        ]
        # Shown in the conversation; the attachment strip is empty again.
        shown = page.locator('.msg[data-role="user"] .chat-images img')
        expect(shown).to_have_count(1)
        assert shown.get_attribute("src") == data_url
        expect(thumbs).to_have_count(0)
        screenshot(page, "chat-image")
        # The API answers the same body the page sent (the image reached the model).
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        again = client.chat.completions.create(
            model="tiny-llava", messages=[{"role": "user", "content": content}],
            max_tokens=4, temperature=0,
        )  # fmt: skip
        assert again.usage.prompt_tokens > 4  # the image's tokens with the words
    finally:
        context.close()
    problems.check()


def test_a_pasted_image_attaches_and_can_be_removed(browser, url: str) -> None:
    context, page, problems = open_page(browser, url)
    paste = """async ([b64, name]) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], name, { type: "image/png" }));
        const event = new ClipboardEvent("paste", { clipboardData: data, cancelable: true });
        document.querySelector("#chat-input").dispatchEvent(event);
    }"""
    try:
        page.goto(f"{url}/admin/#/chat?model=tiny-llava")
        expect(page.locator("#chat-attach")).to_be_enabled()
        page.evaluate(paste, [base64.b64encode(png(90)).decode(), "pasted.png"])
        thumbs = page.locator("#chat-attachments img")
        expect(thumbs).to_have_count(1)
        page.locator('[data-action="remove-image"]').click()
        expect(thumbs).to_have_count(0)
        # A text model: a pasted image is not attached, and the page says why.
        page.select_option('select[name="model"]', "tiny-llama")
        page.evaluate(paste, [base64.b64encode(png(91)).decode(), "pasted.png"])
        expect(page.locator("#chat-attach-notice")).to_contain_text("does not take images")
        expect(thumbs).to_have_count(0)
    finally:
        context.close()
    problems.check()
