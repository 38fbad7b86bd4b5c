"""Web pages attacking a live ``omlx serve`` (no key, on 127.0.0.1) from a real
Chromium: DNS rebinding, cross-site forms and ``no-cors`` fetches, a CORS PUT of
the security settings. Every attack reaches the server and is refused; afterwards
the same models are loaded, settings.json is byte-identical, nothing was
imported or installed, and the admin panel still works in the same browser.

The attacker's pages come from a second HTTP server on another port, under the
name ``evil.example`` (mapped to 127.0.0.1 with ``--host-resolver-rules``) and,
for the other-localhost-port case, under ``localhost``.
"""

from __future__ import annotations

import html
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from omlx.models.builtin import builtin_gguf_path
from tests.e2e.conftest import launch_chromium, open_page
from tests.fixtures.servers import free_port, serve_process

EVIL = "evil.example"
LOADED, UNLOADED = "tiny-llama", "tiny-qwen3"
OPEN_TO_LAN = {"server": {"host": "0.0.0.0", "allow_unauthenticated_remote": True}}


@pytest.fixture(scope="module")
def evil_browser(playwright) -> Iterator:
    """Chromium resolving evil.example to this machine, as a rebinding DNS would."""
    chromium = launch_chromium(
        playwright,
        f"--host-resolver-rules=MAP {EVIL} 127.0.0.1",
        # Chromium's own Local Network Access check would stop some attacks
        # before omlx sees them; Safari and Firefox have none, so neither here.
        "--disable-features=LocalNetworkAccessChecks",
    )
    yield chromium
    chromium.close()


@pytest.fixture(scope="module")
def target(
    e2e_models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, Path]]:
    """(URL, base folder, model dir) of a keyless server with one model loaded."""
    root = tmp_path_factory.mktemp("attacked")
    models = root / "models"
    models.mkdir()
    for name in (LOADED, UNLOADED):
        (models / name).symlink_to(e2e_models_dir / name, target_is_directory=True)
    log = root / "server.log"
    with log.open("w") as err, serve_process(root / "base", models, stderr=err) as (_, url):
        # Loaded the way a real client does it; the attacks try to change this.
        loaded = httpx.post(f"{url}/admin/api/models/{LOADED}/load", json={}, timeout=120)
        assert loaded.status_code == 200, loaded.text
        yield url, root / "base", models
    text = log.read_text()
    assert "importing" not in text and "installing the built-in model" not in text
    assert not re.search(r"released (kv_cache|weights)", text)


def state_of(url: str, base: Path, models: Path) -> dict:
    settings = base / "settings.json"
    return {
        "loaded": sorted(m["name"] for m in httpx.get(url + "/health").json()["loaded_models"]),
        "settings": settings.read_bytes() if settings.exists() else None,
        "model_dirs": sorted(p.name for p in models.iterdir()),
    }


# -- the attacker's pages ------------------------------------------------------------


def form_page(action: str, fields: dict[str, str], enctype: str) -> str:
    """A form that submits itself when the page opens (what a malicious ad does)."""
    inputs = "".join(
        f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">'
        for k, v in fields.items()
    )
    return (
        f'<form method="POST" action="{html.escape(action)}" enctype="{enctype}">{inputs}</form>'
        "<script>document.forms[0].submit()</script>"
    )


def json_as_text_plain(payload: dict) -> dict[str, str]:
    """The classic trick: a text/plain form whose body ``name=value`` is valid JSON."""
    text = json.dumps({**payload, "pad": ""})
    return {text[:-2]: '"}'}  # name=value: ..., "pad": "=" + "}"


def forms(omlx: str, gguf: str) -> dict[str, tuple[str, str]]:
    """Attack name -> (action URL, page HTML)."""
    plain, urlenc = "text/plain", "application/x-www-form-urlencoded"
    attacks = {
        "unload": (f"/admin/api/models/{LOADED}/unload", {}, urlenc),
        "load": (f"/admin/api/models/{UNLOADED}/load", {}, urlenc),
        "release": ("/release_memory_occupation", {"tags": "weights"}, urlenc),
        "release-json": ("/release_memory_occupation", json_as_text_plain({}), plain),
        "cache-clear": ("/admin/api/cache/clear", json_as_text_plain({"tier": "both"}), plain),
        "install-default": ("/admin/api/models/install-default", {}, urlenc),
        "import-gguf": (
            "/admin/api/models/import-gguf",
            json_as_text_plain({"path": gguf, "name": "stolen"}),
            plain,
        ),
        # Forms cannot PUT; a POST to the same path is what a form can do.
        "settings": ("/admin/api/settings", json_as_text_plain(OPEN_TO_LAN), plain),
    }
    return {
        name: (omlx + path, form_page(omlx + path, fields, enctype))
        for name, (path, fields, enctype) in attacks.items()
    }


def fetch_script(omlx: str) -> str:
    """no-cors fetches (text/plain bodies, no preflight) and a CORS PUT (preflighted)."""
    release = json.dumps({"tags": ["weights", "kv_cache"]})
    put = json.dumps(json.dumps(OPEN_TO_LAN))
    return f"""
    const omlx = {json.dumps(omlx)};
    const results = {{}};
    const attempt = async (name, path, init) => {{
      try {{ const r = await fetch(omlx + path, init); results[name] = r.type; }}
      catch (e) {{ results[name] = "blocked: " + e.name; }}
    }};
    await attempt("release", "/release_memory_occupation",
      {{method: "POST", mode: "no-cors", body: {json.dumps(release)}}});
    await attempt("unload", "/admin/api/models/{LOADED}/unload",
      {{method: "POST", mode: "no-cors"}});
    await attempt("cache", "/admin/api/cache/clear",
      {{method: "POST", mode: "no-cors", body: '{{"tier": "both"}}'}});
    await attempt("settings-put", "/admin/api/settings", {{method: "PUT",
      headers: {{"Content-Type": "application/json"}}, body: {put}}});
    return results;
    """


class AttackerSite:
    """The second HTTP server: serves whatever page the test puts at a path."""

    def __init__(self) -> None:
        self.pages: dict[str, str] = {"/": "<title>cute cats</title>"}
        pages = self.pages

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pages.get(self.path, "not here").encode()
                self.send_response(200 if self.path in pages else 404)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def attacker() -> Iterator[AttackerSite]:
    site = AttackerSite()
    yield site
    site.close()


# -- the attacks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def before(target: tuple[str, Path, Path]) -> dict:
    state = state_of(*target)
    assert state["loaded"] == [LOADED]
    return state


@pytest.mark.parametrize("site_host", [EVIL, "localhost"], ids=["cross-site", "other-port"])
def test_cross_site_forms_and_fetches_change_nothing(
    evil_browser, attacker: AttackerSite, target: tuple, before: dict, site_host: str
) -> None:
    url, _, models = target
    gguf = str(builtin_gguf_path() or models / LOADED / "config.json")
    context, page, _ = open_page(evil_browser, url)
    seen: list[tuple[str, int]] = []
    context.on("response", lambda r: r.url.startswith(url) and seen.append((r.url, r.status)))
    site = f"http://{site_host}:{attacker.port}"
    for name, (action, markup) in forms(url, gguf).items():
        attacker.pages[f"/form-{name}"] = markup
        with page.expect_response(lambda r, a=action: r.url == a) as answer:
            page.goto(f"{site}/form-{name}")
        # The request reached omlx and was refused there (not by the browser).
        assert answer.value.status == 403, (name, answer.value.text())
        assert "cross-site request" in answer.value.json()["error"]["message"]
    page.goto(f"{site}/")
    seen.clear()
    results = page.evaluate(f"async () => {{ {fetch_script(url)} }}")
    assert results["settings-put"].startswith("blocked")  # the preflight found no CORS
    page.wait_for_timeout(300)  # the opaque responses' events
    refused = {u.removeprefix(url): s for u, s in seen}
    for path in ("/release_memory_occupation", f"/admin/api/models/{LOADED}/unload"):
        assert refused[path] == 403, refused
    assert refused.get("/admin/api/settings") != 200
    context.close()
    assert state_of(*target) == before


def rebinding_script() -> str:
    """Run on http://evil.example:<omlx port>/ after its name was re-pointed at
    127.0.0.1: same-origin, so it may send JSON and any header and read answers."""
    put = json.dumps(json.dumps(OPEN_TO_LAN))
    return f"""
    const json = {{"Content-Type": "application/json", "X-Omlx-Client": "admin"}};
    const go = async (path, init) => {{
      const r = await fetch(path, init);
      return [r.status, (await r.json()).error.code];
    }};
    return {{
      read: await go("/admin/api/settings", {{}}),
      put: await go("/admin/api/settings", {{method: "PUT", headers: json, body: {put}}}),
      unload: await go("/admin/api/models/{LOADED}/unload", {{method: "POST", headers: json}}),
      release: await go("/release_memory_occupation",
        {{method: "POST", headers: json, body: "{{}}"}}),
      logs: await go("/admin/api/logs", {{}}),
    }};
    """


def test_dns_rebinding_is_refused(evil_browser, target: tuple, before: dict) -> None:
    url, _, _ = target
    port = url.rsplit(":", 1)[1]
    rebound = f"http://{EVIL}:{port}"
    context, page, _ = open_page(evil_browser, url)
    for path in ("/admin/", "/admin/api/settings", "/v1/models"):
        response = page.goto(rebound + path)
        assert response is not None and response.status == 403, path
        assert "server.allowed_hosts" in page.content()
    # The attacker's page was served from evil.example:<port> before the name moved;
    # Playwright plays that first answer, everything after goes to omlx.
    page.route(rebound + "/", lambda route: route.fulfill(body="<title>rebound</title>"))
    page.goto(rebound + "/")
    results = page.evaluate(f"async () => {{ {rebinding_script()} }}")
    assert results == {
        name: [403, "host_not_allowed"] for name in ("read", "put", "unload", "release", "logs")
    }
    context.close()
    assert state_of(*target) == before


def test_the_admin_panel_still_works_in_the_same_browser(
    evil_browser, target: tuple, before: dict
) -> None:
    url, _, _ = target
    context, page, problems = open_page(evil_browser, url)
    page.goto(f"{url}/admin/#/models")
    row = page.locator(f'tr[data-model="{UNLOADED}"]')
    expect(row).to_have_attribute("data-state", "unloaded")
    row.locator('[data-action="load"]').click()
    expect(row).to_have_attribute("data-state", "loaded", timeout=60_000)
    row.locator('[data-action="unload"]').click()
    expect(row).to_have_attribute("data-state", "unloaded")
    page.goto(f"{url}/admin/#/dashboard")
    page.wait_for_selector("#guard-info dl.kv dd >> nth=0")
    context.close()
    problems.check()  # no CSP violation or other console error on the way
