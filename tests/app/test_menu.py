"""The menu model (and its in-place updates), stats lines and login items."""

from __future__ import annotations

import plistlib
from pathlib import Path

import pytest

from app.login_item import (
    LABEL,
    MOVE_FIRST,
    AppServiceLoginItem,
    LoginFile,
    LoginItemError,
    app_bundle_of,
    login_item,
    refusal,
)
from app.menu import STATS_SLOTS, LiveMenu, MenuEntry, build_menu, find, visible, walk
from app.stats import from_stats
from app.status import ModelReadiness, PortOffer, ServerState, Status, readiness_from_health

STATS_BODY = {
    "requests": {"total": 12, "in_flight": 2, "queued": 1},
    "tokens": {"prompt_total": 3400, "completion_total": 1200},
    "throughput": {"decode_tokens_per_s": 41.25},
    "memory": {"used_bytes": 3 * 2**30, "hard_limit_bytes": 24 * 2**30},
    "cache": {"hit_rate": 0.42},
}


def _titles(menu) -> list[str]:
    return [e.title for e in visible(menu) if not e.separator]


def test_stopped_menu_offers_start_only():
    menu = build_menu(Status(), None, login_enabled=False)
    assert menu[0].title == "Stopped" and not menu[0].enabled
    assert find(menu, "Start Server").enabled
    for title in ("Stop Server", "Restart Server", "Open Admin", "Open Chat", "Open in Browser"):
        assert not find(menu, title).enabled, title
    assert _titles(find(menu, "Stats").children) == ["Server not running"]
    assert find(menu, "Quit omlx").action == "quit"


def test_running_menu_shows_port_restarts_and_stats():
    status = Status(ServerState.RUNNING, port=8123, pid=1, num_restarts=2, message="Port moved")
    menu = build_menu(status, from_stats(STATS_BODY), login_enabled=True)
    assert _titles(menu)[:3] == ["Running on :8123", "Restarted 2× after a crash", "Port moved"]
    assert find(menu, "Stop Server").enabled and find(menu, "Open Admin").enabled
    assert not find(menu, "Start Server").enabled
    assert find(menu, "Launch at Login").checked is True
    assert _titles(find(menu, "Stats").children) == [
        "Requests: 2 running, 1 queued, 12 total",
        "Tokens: 3,400 in, 1,200 out",
        "Decode: 41.2 tok/s",
        "Cache hit rate: 42%",
        "Memory: 3.0 GB of 24.0 GB",
    ]


def test_error_and_hang_headlines_give_the_reason():
    assert build_menu(Status(ServerState.ERROR, reason="exit 2"), None, False)[0].title == (
        "Error: exit 2"
    )
    hung = Status(ServerState.NOT_RESPONDING, port=9000, pid=5)
    menu = build_menu(hung, None, False)
    assert menu[0].title == "Not responding on :9000"
    assert find(menu, "Restart Server").enabled  # the way out of a hang


def test_offer_replaces_server_items_and_adopted_server_is_disconnected_not_stopped():
    offered = build_menu(Status(offer=PortOffer(8000, "0.1.0")), None, False)
    assert offered[0].title == "omlx 0.1.0 already running on :8000"
    assert find(offered, "Use the omlx on :8000").action == "use_running"
    assert find(offered, "Start Another on a Free Port").action == "start_other_port"
    adopted = build_menu(Status(ServerState.RUNNING, port=8000, adopted=True), None, False)
    assert adopted[0].title == "Running on :8000 (external)"
    assert find(adopted, "Disconnect").action == "stop"
    assert not find(adopted, "Restart Server").enabled


def test_stats_lines_leave_out_what_is_unknown():
    partial = from_stats({"requests": {"in_flight": 0}, "memory": {"used_bytes": 2**30}})
    assert partial.lines() == ["Requests: 0 running", "Memory: 1.0 GB"]
    assert from_stats({}).lines() == ["No statistics yet"]


def test_launch_agent_on_macos(tmp_path):
    item = login_item(["/Applications/omlx.app/Contents/MacOS/omlx"], tmp_path, "darwin")
    assert item.path == tmp_path / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    item.set_enabled(True)
    agent = plistlib.loads(item.path.read_bytes())
    assert agent["Label"] == LABEL and agent["RunAtLoad"] is True
    assert agent["ProgramArguments"] == ["/Applications/omlx.app/Contents/MacOS/omlx"]
    assert item.is_enabled()
    item.set_enabled(False)
    assert not item.path.exists() and not item.is_enabled()


def test_xdg_autostart_entry_on_linux(tmp_path):
    item = login_item(["/usr/bin/python3", "-m", "app", "--base-path", "/a b"], tmp_path, "linux")
    item.set_enabled(True)
    text = (tmp_path / ".config" / "autostart" / "omlx.desktop").read_text()
    assert text.startswith("[Desktop Entry]\nType=Application\n")
    assert 'Exec=/usr/bin/python3 -m app --base-path "/a b"\n' in text


# -- the menu updated in place -----------------------------------------------------------


class Item:
    """What a front end keeps per entry (macOS: an NSMenuItem), set the way macos.py does."""

    def __init__(self, entry: MenuEntry, children: list[Item]):
        self.children = children
        self.shortcut = entry.shortcut
        self.num_updates = 0
        self.set(entry)

    def set(self, entry: MenuEntry) -> None:
        self.title, self.enabled, self.hidden = entry.title, entry.enabled, entry.hidden
        self.checked = entry.checked

    @staticmethod
    def update(item: Item, entry: MenuEntry) -> None:
        item.num_updates += 1
        item.set(entry)


ALL_STATES = [
    Status(),
    Status(ServerState.STARTING, port=8000, message="Port 8000 is used; using 8001"),
    Status(ServerState.RUNNING, port=8000, pid=3, num_restarts=1),
    Status(ServerState.NOT_RESPONDING, port=8000, pid=3, reason="no /health"),
    Status(ServerState.ERROR, reason="exit 2"),
    Status(offer=PortOffer(8000, "0.1.0")),
    Status(ServerState.RUNNING, port=8000, adopted=True),
]


def test_every_state_has_the_same_layout_so_items_are_made_once():
    layouts = {tuple(e.key for e in walk(build_menu(s, None, False))) for s in ALL_STATES}
    running = build_menu(ALL_STATES[2], from_stats(STATS_BODY), True)
    layouts.add(tuple(e.key for e in walk(running)))
    assert len(layouts) == 1
    keys = next(iter(layouts))
    assert len(keys) == len(set(keys)) and "" not in keys


def test_applying_a_new_status_updates_the_same_items_and_rebuilds_nothing():
    live = LiveMenu(build_menu(Status(), None, False), Item, Item.update)
    items = dict(live.items)
    start, stop = live.items["start"], live.items["stop"]
    assert start.enabled and not stop.enabled

    running = Status(ServerState.RUNNING, port=8123, pid=1)
    changed = live.apply(build_menu(running, from_stats(STATS_BODY), False))
    assert live.items == items  # the very same objects
    assert all(live.items[k] is items[k] for k in items)
    assert live.items["headline"].title == "Running on :8123"
    assert not start.enabled and stop.enabled and live.items["open_admin"].enabled
    assert [live.items[f"stats.{i}"].title for i in range(3)] == [
        "Requests: 2 running, 1 queued, 12 total",
        "Tokens: 3,400 in, 1,200 out",
        "Decode: 41.2 tok/s",
    ]
    assert "quit" not in changed and "open_logs" not in changed
    assert live.items["quit"].num_updates == 0

    # The same state again (a poll with nothing new) touches no item.
    assert live.apply(build_menu(running, from_stats(STATS_BODY), False)) == []

    offered = live.apply(build_menu(Status(offer=PortOffer(8000, "0.1.0")), None, False))
    assert live.items["use_running"].title == "Use the omlx on :8000"
    assert not live.items["use_running"].hidden and start.hidden and stop.hidden
    assert {"use_running", "start", "stop", "restart"} <= set(offered)
    assert live.items["stats.0"].title == "Server not running"
    assert all(live.items[f"stats.{i}"].hidden for i in range(1, STATS_SLOTS))


def test_quit_has_command_q_and_login_is_a_toggle():
    live = LiveMenu(build_menu(Status(), None, False), Item, Item.update)
    assert live.items["quit"].shortcut == "q" and live.items["quit"].title == "Quit omlx"
    assert live.items["toggle_login"].checked is False
    live.apply(build_menu(Status(), None, True))
    assert live.items["toggle_login"].checked is True


def test_a_menu_of_another_shape_is_refused_not_half_applied():
    live = LiveMenu(build_menu(Status(), None, False), Item, Item.update)
    other = build_menu(Status(), None, False)[:-1]
    with pytest.raises(ValueError, match="menu layout changed"):
        live.apply(other)
    assert live.items["quit"].num_updates == 0


# -- models loading at start (issue 24) -------------------------------------------------


def _running(*models: ModelReadiness) -> Status:
    return Status(ServerState.RUNNING, port=8000, pid=3, models=models)


def test_the_menu_shows_the_model_loading_then_ready_in_the_same_item():
    live = LiveMenu(
        build_menu(Status(ServerState.STARTING, port=8000), None, False), Item, Item.update
    )
    line = live.items["models"]
    assert line.hidden  # nothing to say before the server runs

    changed = live.apply(build_menu(_running(ModelReadiness("SmolLM2", "loading")), None, False))
    assert "models" in changed and live.items["models"] is line
    assert line.title == "Loading SmolLM2…" and not line.hidden and not line.enabled
    assert live.items["headline"].title == "Running on :8000"

    changed = live.apply(build_menu(_running(ModelReadiness("SmolLM2", "ready")), None, False))
    assert changed == ["models"] and line.title == "SmolLM2 ready"

    live.apply(build_menu(Status(), None, False))  # stopped: the line goes away
    assert line.hidden


def test_the_layout_is_the_same_whatever_the_models_do():
    states = [
        _running(),
        _running(ModelReadiness("a", "loading"), ModelReadiness("b", "loading")),
        _running(ModelReadiness("a", "failed", "x" * 300)),
    ]
    layouts = {tuple(e.key for e in walk(build_menu(s, None, False))) for s in states}
    layouts.add(tuple(e.key for e in walk(build_menu(Status(), None, False))))
    assert len(layouts) == 1


def test_model_lines_name_every_loading_model_and_a_failure_with_its_reason_cut():
    both = _running(ModelReadiness("a", "ready"), ModelReadiness("b", "loading"))
    assert both.models_line() == "Loading b…"
    assert _running(ModelReadiness("a", "ready"), ModelReadiness("b", "ready")).models_line() == (
        "a, b ready"
    )
    failed = _running(ModelReadiness("a", "ready"), ModelReadiness("b", "failed", "x" * 300))
    line = failed.models_line()
    assert line.startswith("b failed to load: xxx") and line.endswith("…") and len(line) < 120
    assert _running().models_line() == ""  # nothing loads at start: no line


def test_readiness_is_read_from_a_health_body_and_older_servers_report_none():
    body = {
        "status": "ok",
        "models_state": "failed",
        "models": [
            {"name": "a", "state": "ready", "kv_profile": "reused"},
            {"name": "b", "state": "failed", "reason": "weights unreadable"},
            {"state": "ready"},  # no name: skipped
        ],
    }
    assert readiness_from_health(body) == (
        ModelReadiness("a", "ready"),
        ModelReadiness("b", "failed", "weights unreadable"),
    )
    assert readiness_from_health({"status": "ok", "loaded_models": []}) == ()
    assert readiness_from_health(["not", "a", "dict"]) == ()


# -- Launch at Login on macOS: the decision, testable anywhere -----------------------------

TRANSLOCATED = (
    "/private/var/folders/xy/abc/T/AppTranslocation/1A2B3C4D-5E6F/d/omlx.app/Contents/MacOS/omlx"
)


def test_the_bundle_is_found_from_its_launcher():
    assert app_bundle_of("/Applications/omlx.app/Contents/MacOS/omlx") == Path(
        "/Applications/omlx.app"
    )
    assert app_bundle_of("/usr/bin/python3") is None


def test_launch_at_login_is_refused_while_translocated_or_on_a_disk_image():
    assert refusal(app_bundle_of(TRANSLOCATED)) == MOVE_FIRST == "move omlx to Applications first"
    assert refusal(Path("/Volumes/omlx/omlx.app")) == MOVE_FIRST
    assert refusal(Path("/Applications/omlx.app")) is None
    assert refusal(Path.home() / "Applications" / "omlx.app") is None


def test_frozen_app_uses_the_app_service_and_refuses_before_touching_it(tmp_path):
    item = login_item([TRANSLOCATED], tmp_path, "darwin", frozen=True)
    assert isinstance(item, AppServiceLoginItem)
    assert item.bundle == app_bundle_of(TRANSLOCATED)
    # An old LaunchAgent stays until the service is really asked (it is the only
    # launcher the user has now).
    agent = tmp_path / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    agent.parent.mkdir(parents=True)
    agent.write_bytes(b"old")
    with pytest.raises(LoginItemError, match="move omlx to Applications first"):
        item.set_enabled(True)  # raised before ServiceManagement is imported
    assert agent.exists()
    # Unbundled (from source) macOS keeps its LaunchAgent.
    dev = login_item(["/opt/homebrew/bin/python3", "-m", "app"], tmp_path, "darwin")
    assert isinstance(dev, LoginFile) and dev.path == agent


def test_an_unwritable_autostart_folder_is_a_message_not_a_crash(make_controller, tmp_path):
    controller, _ = make_controller()
    home = tmp_path / "home"
    home.mkdir()
    (home / ".config").write_text("a file where the folder should be")
    controller.login = login_item(["omlx-app"], home, "linux")
    controller.dispatch("toggle_login").result()
    message = controller.menu()[2]
    assert message.key == "message" and not message.hidden
    assert message.title.startswith("Launch at Login: cannot write ")
    assert "omlx.desktop" in message.title
    assert find(controller.menu(), "Launch at Login").checked is False
    controller.dispatch("open_logs").result()  # the next action clears the notice
    assert controller.menu()[2].hidden
