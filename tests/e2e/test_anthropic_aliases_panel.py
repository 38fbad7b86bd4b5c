"""models.anthropic_aliases on the admin Settings page: shown, changed live, refused
next to the field when a target is not served."""

from __future__ import annotations

import anthropic
import httpx
from playwright.sync_api import expect

ASK = [{"role": "user", "content": "Hi"}]


def test_anthropic_aliases_edit_live_and_a_bad_target_is_refused(page, admin_url: str) -> None:
    page.goto(f"{admin_url}/admin/#/settings")
    field = page.locator('[data-field="models.anthropic_aliases"]')
    aliases = field.locator("input")
    expect(aliases).to_have_value("claude-*=")  # the default: claude-* -> the default model
    expect(field.locator(".badge.ok")).to_have_text("live")

    aliases.fill("claude-*=, claude-haiku-*=tiny-qwen3")
    page.click('button:has-text("Save changes")')
    expect(page.locator("#settings-result")).to_have_text("Saved and applied.")
    saved = httpx.get(admin_url + "/admin/api/settings").json()["settings"]["models"]
    assert saved["anthropic_aliases"] == {"claude-*": None, "claude-haiku-*": "tiny-qwen3"}
    client = anthropic.Anthropic(base_url=admin_url, api_key="unused", max_retries=0)
    out = client.messages.create(model="claude-haiku-4-5", messages=ASK, max_tokens=1)
    assert out.model == "tiny-qwen3"

    aliases.fill("claude-*=no-such-model")
    page.click('button:has-text("Save changes")')
    expect(field.locator(".error")).to_contain_text("no-such-model")
    expect(field.locator(".error")).to_contain_text("is not a served model")
    after = httpx.get(admin_url + "/admin/api/settings").json()["settings"]["models"]
    assert after["anthropic_aliases"] == saved["anthropic_aliases"]
