"""Helpers for the desktop-shell tests: a controller on a real `omlx serve` child."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.controller import AppConfig, Controller
from app.login_item import login_item
from app.ports import free_port
from app.status import ServerState, Status
from app.supervisor import SupervisorPolicy
from app.updater import Updater
from tests.app.fake_release import FeedServer

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"

# Short intervals so crash, hang and restart happen within seconds.
FAST = SupervisorPolicy(
    poll_interval_s=0.2,
    health_timeout_s=1.0,
    start_timeout_s=90.0,
    max_failed_polls=2,
    hang_restart_s=600.0,
    stop_timeout_s=20.0,
    backoff_base_s=0.5,
    backoff_max_s=4.0,
    max_crashes=3,
    stable_s=30.0,
)


def wait_for(check: Callable[[], bool], timeout_s: float = 90.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


class Recorder:
    """Every status the controller published, in order (as a front end sees them)."""

    def __init__(self) -> None:
        self.statuses: list[Status] = []

    def __call__(self, status: Status, _menu: object) -> None:
        self.statuses.append(status)

    def states(self) -> list[ServerState]:
        return [s.state for s in self.statuses]


@pytest.fixture
def make_controller(
    tmp_path: Path, tiny_models_dir: Path
) -> Iterator[Callable[..., tuple[Controller, Recorder]]]:
    made: list[Controller] = []

    def make(
        port: int | None = None,
        policy: SupervisorPolicy = FAST,
        extra: tuple = (),
        updater: Updater | None = None,
        **config_fields: object,
    ):
        config = AppConfig(
            base_path=tmp_path / "base",
            port=port or free_port(),
            extra_args=("--model-dir", str(tiny_models_dir), "--no-install-default", *extra),
            policy=policy,
            stats_interval_s=0.2,
            **config_fields,  # type: ignore[arg-type]
        )
        login = login_item(["omlx-app"], home=tmp_path / "home")
        controller = Controller(config, login=login, updater=updater)
        recorder = Recorder()
        controller.add_listener(recorder)
        controller.start_monitor()
        made.append(controller)
        return controller, recorder

    yield make
    for controller in made:
        controller.shutdown()


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Path, FeedServer]]:
    root = tmp_path / "site"
    root.mkdir()
    server = FeedServer(root)
    yield root, server
    server.close()
