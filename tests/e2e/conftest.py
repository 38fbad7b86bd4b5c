"""Browser fixtures: Debian's Chromium driven by Playwright against a real ``omlx serve``.

Playwright's own browser download cannot work here, so the system Chromium is
used; without it the browser tests skip with that reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.fixtures.servers import serve_process
from tests.fixtures.tiny_models import build_tiny_model

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).parent / "artifacts"
# Chromium reports every 4xx/5xx response as a console error; the tests cause some
# on purpose (an invalid setting is a 400), so responses are checked on their own.
_NETWORK_NOISE = re.compile(r"^Failed to load resource: the server responded with a status of")


@dataclass(slots=True)
class PageProblems:
    console_errors: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)

    def check(self) -> None:
        assert not self.console_errors, f"console errors: {self.console_errors}"
        assert not self.server_errors, f"server errors: {self.server_errors}"


# Flags every test browser needs here (root, no GPU, a small /dev/shm).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


@pytest.fixture(scope="package")
def playwright() -> Iterator:
    """One Playwright for the package: its sync API refuses a second one running."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; setup.sh test does it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        yield pw


def launch_chromium(playwright, *extra_args: str):
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=[*CHROMIUM_ARGS, *extra_args]
    )


@pytest.fixture(scope="package")
def browser(playwright) -> Iterator:
    chromium = launch_chromium(playwright)
    yield chromium
    chromium.close()


@pytest.fixture(scope="session")
def e2e_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Models of our own: imports and quantized outputs land here, not in the shared dir."""
    root = tmp_path_factory.mktemp("e2e-models")
    build_tiny_model(root / "tiny-llama", "llama", seed=0)
    build_tiny_model(root / "tiny-qwen3", "qwen3", seed=1)
    build_tiny_model(root / "slow-llama", "slow-llama", seed=2)
    return root


@pytest.fixture(scope="session")
def e2e_profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``profiles`` folder for the servers on e2e_models_dir: a model's auto-profile
    and an architecture's probe verdict, measured by one server, are reused by the next,
    as by a restart of one (each server keeps its own settings and logs)."""
    return tmp_path_factory.mktemp("e2e-profiles")


def base_sharing_profiles(base: Path, profiles: Path) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    (base / "profiles").symlink_to(profiles, target_is_directory=True)
    return base


@pytest.fixture(scope="module")
def admin_url(
    e2e_models_dir: Path, e2e_profiles: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``omlx serve`` (the real CLI, so it writes logs/server.log) without a key."""
    base = base_sharing_profiles(tmp_path_factory.mktemp("e2e-base"), e2e_profiles)
    with serve_process(base, e2e_models_dir, "--max-concurrent-requests", "8") as (_, url):
        yield url


def open_page(browser, url: str, **context_options):
    """A fresh context and page, with console and server errors collected."""
    context = browser.new_context(viewport={"width": 1360, "height": 900}, **context_options)
    page = context.new_page()
    problems = PageProblems()

    def on_console(msg) -> None:
        if msg.type == "error" and not _NETWORK_NOISE.match(msg.text):
            problems.console_errors.append(msg.text)

    page.on("console", on_console)
    page.on("pageerror", lambda exc: problems.console_errors.append(f"uncaught: {exc}"))
    page.on(
        "response",
        lambda r: r.status >= 500 and problems.server_errors.append(f"{r.status} {r.url}"),
    )
    page.set_default_timeout(20_000)
    return context, page, problems


@pytest.fixture
def page(browser, admin_url: str) -> Iterator:
    context, pg, problems = open_page(browser, admin_url)
    yield pg
    context.close()
    problems.check()


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.evaluate("window.scrollTo(0, 0)")  # sticky bars land where they belong
    page.screenshot(path=str(path), full_page=True)
    return path
