"""The menu model, stats lines and login items: pure data, no processes."""

from __future__ import annotations

import plistlib

from app.login_item import LABEL, login_item
from app.menu import build_menu, find
from app.stats import from_stats
from app.status import PortOffer, ServerState, Status

STATS_BODY = {
    "requests": {"total": 12, "in_flight": 2, "queued": 1},
    "tokens": {"prompt_total": 3400, "completion_total": 1200},
    "throughput": {"decode_tokens_per_s": 41.25},
    "memory": {"used_bytes": 3 * 2**30, "hard_limit_bytes": 24 * 2**30},
    "cache": {"hit_rate": 0.42},
}


def _titles(menu) -> list[str]:
    return [e.title for e in menu if not e.separator]


def test_stopped_menu_offers_start_only():
    menu = build_menu(Status(), None, login_enabled=False)
    assert menu[0].title == "Stopped" and not menu[0].enabled
    assert find(menu, "Start Server").enabled
    for title in ("Stop Server", "Restart Server", "Open Admin", "Open Chat", "Open in Browser"):
        assert not find(menu, title).enabled, title
    assert [e.title for e in find(menu, "Stats").children] == ["Server not running"]
    assert find(menu, "Quit omlx").action == "quit"


def test_running_menu_shows_port_restarts_and_stats():
    status = Status(ServerState.RUNNING, port=8123, pid=1, num_restarts=2, message="Port moved")
    menu = build_menu(status, from_stats(STATS_BODY), login_enabled=True)
    assert _titles(menu)[:3] == ["Running on :8123", "Restarted 2× after a crash", "Port moved"]
    assert find(menu, "Stop Server").enabled and find(menu, "Open Admin").enabled
    assert not find(menu, "Start Server").enabled
    assert find(menu, "Launch at Login").checked is True
    assert [e.title for e in find(menu, "Stats").children] == [
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
