"""The menu's app items through the controller: About, Check for Updates… and the install
(a real server stopped before the swap), the daily check, Reveal Data Folder, Uninstall.

The release is `fake_release`'s (the build's own disk-image code over real HTTP); the
updater runs with `LinuxCalls` (see app/platform_calls.py for what stands in for macOS).
"""

from __future__ import annotations

import json
import os
import plistlib
import re
from pathlib import Path

import psutil
import pytest
from omlx_build.plist import info_plist

from app import paths
from app.controller import AppConfig
from app.login_item import login_item
from app.menu import AppItems, build_menu, find, visible, walk
from app.platform_calls import LinuxCalls
from app.status import ServerState, Status
from app.uninstall import UninstallError, check_removable
from app.updater import Updater
from omlx import __version__
from tests.app.conftest import wait_for
from tests.app.fake_release import load_config, make_app, make_dmg, publish, sha256_of, tree_digest

# Records whether the server of the old app was still running when the new one started.
LAUNCHER_CHECKING_SERVER = """#!/bin/sh
if kill -0 {{pid}} 2>/dev/null; then state=alive; else state=gone; fi
echo "relaunched {version}, server $state" > "{marker}"
"""


def _message(controller) -> str:
    line = controller.menu()[2]
    assert line.key == "message"
    return "" if line.hidden else line.title


def _titles(menu) -> list[str]:
    return [e.title for e in visible(menu) if not e.separator]


def test_every_app_item_state_keeps_the_layout_and_the_items_show_what_applies():
    plain = build_menu(Status(), None, False)
    offered = AppItems(update_version="0.2.0", uninstall_total="1.5 GB")
    layouts = {
        tuple(e.key for e in walk(build_menu(Status(), None, False, items)))
        for items in (AppItems(), offered, AppItems(updating=True))
    }
    assert len(layouts) == 1
    titles = _titles(plain)
    for title in ("About omlx", "Check for Updates…", "Reveal Data Folder", "Uninstall omlx…"):
        assert title in titles
    assert "Delete All omlx Data" not in " ".join(titles) and "Keep Data" not in titles
    assert not any(t.startswith("Install omlx") for t in titles)
    menu = build_menu(Status(), None, False, offered)
    assert find(menu, "Install omlx 0.2.0 and Relaunch").action == "install_update"
    assert find(menu, "Delete All omlx Data (1.5 GB)").action == "uninstall_confirm"
    assert find(menu, "Keep Data").action == "uninstall_cancel"
    busy = build_menu(Status(), None, False, AppItems(updating=True))
    assert not find(busy, "Check for Updates…").enabled
    assert _titles(plain)[-1] == "Quit omlx"


def test_check_then_install_stops_the_server_swaps_the_app_and_relaunches(
    make_controller, site, tmp_path
):
    root, server = site
    installed = make_app(tmp_path / "Applications", "0.1.0", tmp_path / "old-relaunched")
    updater = Updater(server.url("omlx-update.json"), __version__, installed, LinuxCalls())
    controller, _ = make_controller(updater=updater)
    quits: list[bool] = []
    controller.on_quit = lambda: quits.append(True)
    controller.dispatch("start").result()
    wait_for(lambda: controller.status.state is ServerState.RUNNING, what="the server")
    pid = controller.status.pid
    newer = _next_version(__version__)
    marker = tmp_path / "relaunched"
    launcher = LAUNCHER_CHECKING_SERVER.replace("{{pid}}", str(pid))
    image = make_dmg(tmp_path, newer, marker, root / f"omlx-{newer}.dmg", launcher)
    publish(root, image, newer, sha256_of(image))

    controller.dispatch("check_updates").result()
    assert _message(controller) == f"omlx {newer} is available (you have {__version__})"
    assert find(controller.menu(), f"Install omlx {newer} and Relaunch").enabled

    controller.dispatch("install_update").result()
    wait_for(marker.exists, 10, "the new app to start")
    assert marker.read_text() == f"relaunched {newer}, server gone\n"
    assert quits == [True]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    info = plistlib.loads((installed / "Contents" / "Info.plist").read_bytes())
    assert info["CFBundleShortVersionString"] == newer


def test_a_refused_install_keeps_the_app_and_the_server(make_controller, site, tmp_path):
    root, server = site
    installed = make_app(tmp_path / "Applications", "0.1.0", tmp_path / "old-relaunched")
    before = tree_digest(installed)
    updater = Updater(server.url("omlx-update.json"), __version__, installed, LinuxCalls())
    controller, _ = make_controller(updater=updater)
    controller.dispatch("start").result()
    wait_for(lambda: controller.status.state is ServerState.RUNNING, what="the server")
    newer = _next_version(__version__)
    image = make_dmg(tmp_path, newer, tmp_path / "relaunched", root / f"omlx-{newer}.dmg")
    publish(root, image, newer, "0" * 64)  # not this image's digest

    controller.dispatch("check_updates").result()
    controller.dispatch("install_update").result()
    assert _message(controller).startswith("Update not installed: the downloaded disk image")
    assert tree_digest(installed) == before
    assert controller.status.state is ServerState.RUNNING


def test_the_daily_check_announces_an_update_without_being_asked(make_controller, site, tmp_path):
    root, server = site
    newer = _next_version(__version__)
    publish(root, tmp_path / f"omlx-{newer}.dmg", newer, None)
    updater = Updater(server.url("omlx-update.json"), __version__, None, LinuxCalls())
    controller, _ = make_controller(updater=updater, first_update_check_s=0.2)
    wait_for(lambda: "/omlx-update.json" in server.requests, 10, "the background check")
    wait_for(lambda: _message(controller).startswith(f"omlx {newer} is available"), 10, "news")
    assert find(controller.menu(), f"Install omlx {newer} and Relaunch")


def test_up_to_date_and_unreachable_say_so(make_controller, site, tmp_path):
    root, server = site
    newer = _next_version(__version__)
    publish(root, tmp_path / "new.dmg", newer, None)
    feed = server.url("omlx-update.json")
    controller, _ = make_controller(updater=Updater(feed, __version__, None, LinuxCalls()))
    controller.dispatch("check_updates").result()
    assert find(controller.menu(), f"Install omlx {newer} and Relaunch")

    controller.updater = Updater(server.url("gone.json"), __version__, None, LinuxCalls())
    controller.dispatch("check_updates").result()
    assert _message(controller) == (
        f"Can't reach the update server: {server.url('gone.json')} answered HTTP 404"
    )
    assert find(controller.menu(), f"Install omlx {newer} and Relaunch")  # what we knew still holds

    publish(root, tmp_path / "same.dmg", __version__, None)
    controller.updater = Updater(feed, __version__, None, LinuxCalls())
    controller.dispatch("check_updates").result()
    assert _message(controller) == (f"You're up to date: omlx {__version__} is the newest version")
    with pytest.raises(KeyError):
        find(controller.menu(), f"Install omlx {newer} and Relaunch")


def test_with_no_feed_set_checking_asks_no_one(make_controller):
    controller, _ = make_controller()  # AppConfig's update_feed is empty
    assert controller.updater.feed_url == ""
    controller.dispatch("check_updates").result()
    assert _message(controller) == "Update checks are off (the app.update_feed setting is empty)"


def test_about_names_the_version_and_build(make_controller):
    controller, _ = make_controller()
    controller.dispatch("about").result()
    assert re.fullmatch(
        rf"omlx {re.escape(__version__)} \(build dev( [0-9a-f]+)?\), data in .+/base",
        _message(controller),
    )


def test_reveal_data_folder_opens_it_with_the_desktop_opener(make_controller, tmp_path):
    """xdg-open is replaced by a script on PATH that records its argument (no desktop here)."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "opened"
    bin_dir.mkdir()
    (bin_dir / "xdg-open").write_text(f'#!/bin/sh\necho "$1" > "{seen}"\n')
    (bin_dir / "xdg-open").chmod(0o755)
    controller, _ = make_controller()
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{path}"
    try:
        controller.dispatch("reveal_data").result()
    finally:
        os.environ["PATH"] = path
    assert seen.read_text() == f"{controller.config.base_path}\n"
    assert _message(controller) == ""


def test_uninstall_removes_the_login_item_then_the_data_after_a_yes(make_controller, tmp_path):
    controller, _ = make_controller()
    controller.login = login_item(["omlx-app"], home=tmp_path / "home", platform="linux")
    controller.dispatch("toggle_login").result()
    assert controller.login.is_enabled()
    base = controller.config.base_path
    for name, size in (("models/m/weights", 3_000_000), ("cache/b", 2_000), ("logs/a.log", 500)):
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_bytes(b"x" * size)

    controller.dispatch("uninstall").result()
    assert not controller.login.is_enabled()
    assert _message(controller) == (
        f"Launch at Login is off. Delete {base} too? models 3 MB, cache 2 KB, logs 500 B, other 0 B"
    )
    confirm = find(controller.menu(), "Delete All omlx Data (3 MB)")
    controller.dispatch("uninstall_cancel").result()
    assert base.is_dir() and find(controller.menu(), "Uninstall omlx…")
    with pytest.raises(KeyError):
        find(controller.menu(), confirm.title)

    controller.dispatch("start").result()
    wait_for(lambda: controller.status.state is ServerState.RUNNING, what="the server")
    controller.dispatch("uninstall").result()
    controller.dispatch("uninstall_confirm").result()
    assert not base.exists()
    assert controller.status.state is ServerState.STOPPED  # stopped before its folder went
    assert _message(controller).startswith(f"Deleted {base} (")


def test_uninstall_refuses_to_delete_a_home_folder():
    with pytest.raises(UninstallError, match="is not an omlx data folder"):
        check_removable(Path.home())
    with pytest.raises(UninstallError, match="is not an omlx data folder"):
        check_removable(Path("/"))


def _next_version(version: str) -> str:
    major, minor, *_ = (int(p) for p in [*re.findall(r"\d+", version), "0", "0"])
    return f"{major}.{minor + 1}.0"


def test_the_feed_comes_from_settings_and_defaults_to_the_releases(tmp_path, monkeypatch):
    """Unset, the feed is the one the app was built with (the release workflow's own
    releases, in Info.plist as the build writes it); from source there is none."""
    base = tmp_path / "base"
    assert AppConfig.from_settings(base).update_feed == ""  # from source: no checks
    releases = "https://github.com/someone/omlx/releases/latest/download/omlx-update.json"
    monkeypatch.setenv("OMLX_UPDATE_FEED", releases)
    bundle = tmp_path / "omlx.app"
    (bundle / "Contents").mkdir(parents=True)
    plist = info_plist(load_config())
    (bundle / "Contents" / "Info.plist").write_bytes(plistlib.dumps(plist))
    assert paths.update_feed_of(bundle) == releases
    base.mkdir()
    for off in ("", "off"):  # "off": what the panel's field or `omlx config set` sends
        (base / "settings.json").write_text(json.dumps({"app": {"update_feed": off}}))
        assert AppConfig.from_settings(base).update_feed == ""  # the user turned checks off
