"""The updater end to end on Linux: a real HTTP feed, a disk image made by the build's own
code, the swap and the relaunch through the same steps the Mac takes.

Stand-ins, because the real ones cannot run here: the disk image is the xorriso ISO/HFS+
hybrid `build.py dmg-layout` writes (read back by `LinuxCalls.attach` instead of mounted
with hdiutil), the app in it is `skeleton_app`'s real Info.plist and resources with a
launcher script that records it was started, and Linux has no code signing (the ad-hoc
rule applies: the feed's SHA-256). The signature rule itself is tested on `codesign`'s
real output format.
"""

from __future__ import annotations

import plistlib
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from app.platform_calls import LinuxCalls, Signature, team_identifier
from app.ports import free_port
from app.update_feed import FeedError, Release, is_newer, parse_feed
from app.updater import Outcome, UpdateError, Updater, macos_problem, signature_problem
from tests.app.conftest import wait_for
from tests.app.fake_release import (
    FeedServer,
    make_app,
    make_dmg,
    publish,
    sha256_of,
    tree_digest,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("xorriso") is None, reason="needs xorriso")


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    return make_app(tmp_path / "Applications", "0.1.0", tmp_path / "old-relaunched")


def updater(feed_url: str, app: Path | None, **kwargs: object) -> Updater:
    return Updater(feed_url, "0.1.0", app, LinuxCalls(), timeout_s=10, **kwargs)  # type: ignore[arg-type]


# -- the bar: an update swapped in from a local feed; a tampered one refused ----------------


def test_an_update_from_a_local_feed_is_verified_swapped_in_and_relaunched(
    tmp_path, site, installed
):
    root, server = site
    marker = tmp_path / "relaunched"
    image = make_dmg(tmp_path, "0.2.0", marker, root / "omlx-0.2.0.dmg")
    # The feed as a release writes it.
    feed = subprocess.run(
        [sys.executable, "-m", "app.update_feed", str(image), "0.2.0", "Faster."],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    (root / "omlx-update.json").write_text(feed)
    before = tree_digest(installed)
    up = updater(server.url("omlx-update.json"), installed)

    result = up.check()
    assert result.outcome is Outcome.AVAILABLE
    assert result.release == Release(
        "0.2.0", server.url("omlx-0.2.0.dmg"), sha256_of(image), "Faster."
    )
    assert result.message("0.1.0") == "omlx 0.2.0 is available (you have 0.1.0)"

    staged = up.prepare(result.release)
    assert tree_digest(installed) == before  # downloaded and verified: nothing replaced yet
    assert "/omlx-0.2.0.dmg" in server.requests

    assert up.swap(staged) == installed
    info = plistlib.loads((installed / "Contents" / "Info.plist").read_bytes())
    assert info["CFBundleShortVersionString"] == "0.2.0"
    # The old app waits aside (the running process may still read it) ...
    names = sorted(p.name for p in installed.parent.iterdir())
    assert names[0].startswith(".omlx.app.old-") and names[1:] == ["omlx.app"]

    up.relaunch()
    wait_for(lambda: marker.exists(), 10, "the new app to start")
    assert marker.read_text() == "relaunched 0.2.0\n"
    assert not (tmp_path / "old-relaunched").exists()
    # ... until the new one starts and clears it.
    assert updater(server.url("omlx-update.json"), installed).remove_leftovers()
    assert sorted(p.name for p in installed.parent.iterdir()) == ["omlx.app"]


def test_a_tampered_disk_image_is_refused_and_the_old_app_is_untouched(tmp_path, site, installed):
    root, server = site
    genuine = make_dmg(tmp_path, "0.2.0", tmp_path / "relaunched", tmp_path / "genuine.dmg")
    # Same name and version, other contents (a launcher that does something else).
    tampered = make_dmg(tmp_path, "0.2.0", tmp_path / "evil", root / "omlx-0.2.0.dmg")
    assert sha256_of(tampered) != sha256_of(genuine)
    publish(root, tampered, "0.2.0", sha256_of(genuine))
    before = tree_digest(installed)
    up = updater(server.url("omlx-update.json"), installed)

    release = up.check().release
    with pytest.raises(UpdateError, match=r"SHA-256 is .* not the .* update feed publishes"):
        up.prepare(release)
    assert tree_digest(installed) == before
    assert sorted(p.name for p in installed.parent.iterdir()) == ["omlx.app"]


def test_an_ad_hoc_build_without_a_published_sha256_is_not_even_downloaded(
    tmp_path, site, installed
):
    root, server = site
    image = make_dmg(tmp_path, "0.2.0", tmp_path / "relaunched", root / "omlx-0.2.0.dmg")
    publish(root, image, "0.2.0", None)
    up = updater(server.url("omlx-update.json"), installed)
    with pytest.raises(UpdateError, match="no SHA-256 for this ad-hoc-signed build"):
        up.prepare(up.check().release)
    assert "/omlx-0.2.0.dmg" not in server.requests


def test_a_disk_image_holding_another_version_is_refused(tmp_path, site, installed):
    root, server = site
    image = make_dmg(tmp_path, "0.1.5", tmp_path / "relaunched", root / "omlx-0.2.0.dmg")
    publish(root, image, "0.2.0", sha256_of(image))
    before = tree_digest(installed)
    up = updater(server.url("omlx-update.json"), installed)
    with pytest.raises(UpdateError, match=r"holds omlx 0\.1\.5, not 0\.2\.0"):
        up.prepare(up.check().release)
    assert tree_digest(installed) == before
    assert sorted(p.name for p in installed.parent.iterdir()) == ["omlx.app"]


def test_a_failed_swap_puts_the_old_app_back(tmp_path, installed):
    before = tree_digest(installed)
    up = updater("http://127.0.0.1:9/feed.json", installed)
    staging = installed.parent / ".omlx-update-test"
    staging.mkdir()
    with pytest.raises(UpdateError, match="cannot move the new app into place"):
        up.swap(staging / "omlx.app")  # the staged app vanished: the move-in fails
    assert tree_digest(installed) == before
    assert sorted(p.name for p in installed.parent.iterdir()) == ["omlx.app"]


def test_from_source_there_is_no_app_to_replace(site):
    _root, server = site
    with pytest.raises(UpdateError, match="runs from source"):
        updater(server.url("omlx-update.json"), None).prepare(Release("0.2.0", "http://x/a.dmg"))


# -- checking: up to date, unreachable, and no network call when it must not -------------


def test_up_to_date(tmp_path, site, installed):
    root, server = site
    publish(root, tmp_path / "omlx-0.1.0.dmg", "0.1.0", None)
    result = updater(server.url("omlx-update.json"), installed).check()
    assert result.outcome is Outcome.UP_TO_DATE
    assert result.message("0.1.0") == "You're up to date: omlx 0.1.0 is the newest version"


def test_a_server_that_is_down_or_has_no_feed_is_unreachable(site, installed):
    _root, server = site
    down = updater(f"http://127.0.0.1:{free_port()}/omlx-update.json", installed).check()
    assert down.outcome is Outcome.UNREACHABLE
    assert down.message("0.1.0").startswith("Can't reach the update server: no connection to")
    missing = updater(server.url("nothing.json"), installed).check()
    assert missing.message("0.1.0") == (
        f"Can't reach the update server: {server.url('nothing.json')} answered HTTP 404"
    )


def test_no_network_call_when_the_feed_is_unset_or_the_machine_is_offline(tmp_path, installed):
    address = _routable_address()
    if address is None:
        pytest.skip("no non-loopback address to serve the feed on")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "omlx-update.json").write_text('{"version": "9.0", "url": "a.dmg"}')
    server = FeedServer(tmp_path / "site", host=address)
    try:
        feed = server.url("omlx-update.json", host=address)
        offline = updater(feed, installed, online=lambda: False).check()
        assert offline.outcome is Outcome.OFFLINE
        assert offline.message("0.1.0") == "Can't reach the update server: this Mac is offline"
        assert updater("", installed).check().outcome is Outcome.DISABLED
        assert server.requests == []
        # The same feed online is asked (so the two above really made no call).
        assert updater(feed, installed, online=lambda: True).check().outcome is Outcome.AVAILABLE
        assert server.requests == ["/omlx-update.json"]
    finally:
        server.close()


def _routable_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith(("127.", "169.254.")):
                return addr.address
    return None


# -- the feed and the signature rule ---------------------------------------------------------


def test_feed_parsing_resolves_relative_urls_and_names_what_is_wrong():
    feed = "https://example.com/releases/latest/omlx-update.json"
    release = parse_feed(
        b'{"version": "0.2.0", "url": "omlx.dmg", "sha256": "' + b"A" * 64 + b'"}', feed
    )
    assert release.dmg_url == "https://example.com/releases/latest/omlx.dmg"
    assert release.sha256 == "a" * 64
    for body, message in [
        (b"<rss/>", "is not JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"url": "a.dmg"}', "has no 'version'"),
        (b'{"version": "soon", "url": "a.dmg"}', "'soon' is not a version number"),
        (b'{"version": "1.0"}', "has no 'url'"),
        (b'{"version": "1.0", "url": "file:///etc/passwd"}', "is not http"),
        (b'{"version": "1.0", "url": "a.dmg", "sha256": "abc"}', "is not 64 hex digits"),
    ]:
        with pytest.raises(FeedError, match=message):
            parse_feed(body, feed)


def test_versions_compare_as_versions_not_text():
    assert is_newer(Release("0.10.0", "u"), "0.9.0")
    assert not is_newer(Release("0.1.0", "u"), "0.1.0")
    assert not is_newer(Release("0.2.0rc1", "u"), "0.2.0")


CODESIGN_DEVELOPER_ID = """Executable=/Applications/omlx.app/Contents/MacOS/omlx
Identifier=dev.omlx.app
Format=app bundle with Mach-O thin (arm64)
CodeDirectory v=20500 size=1234 flags=0x10000(runtime) hashes=28+7 location=embedded
Signature size=9050
Authority=Developer ID Application: Example Org (AB12CD34EF)
Authority=Developer ID Certification Authority
Authority=Apple Root CA
Timestamp=1 Nov 2026 at 10:00:00
Notarization Ticket=stapled
TeamIdentifier=AB12CD34EF
Runtime Version=14.0.0
Sealed Resources version=2 rules=13 files=4210
Internal requirements count=1 size=180
"""
CODESIGN_AD_HOC = """Executable=/Applications/omlx.app/Contents/MacOS/omlx
Identifier=dev.omlx.app
Format=app bundle with Mach-O thin (arm64)
CodeDirectory v=20400 size=1234 flags=0x2(adhoc) hashes=28+7 location=embedded
Signature=adhoc
TeamIdentifier=not set
Sealed Resources version=2 rules=13 files=4210
"""


def test_the_team_identifier_is_read_from_codesign_and_must_match():
    team = team_identifier(CODESIGN_DEVELOPER_ID)
    assert team == "AB12CD34EF" and team_identifier(CODESIGN_AD_HOC) is None
    running = Signature(valid=True, team_id=team, notarized=True)
    assert signature_problem(running, Signature(True, team, True)) is None
    assert signature_problem(running, Signature(True, "ZZ99ZZ99ZZ", True)) == (
        "it is signed by team ZZ99ZZ99ZZ, not AB12CD34EF"
    )
    assert "none (ad hoc)" in signature_problem(running, Signature(True, None, False))
    assert signature_problem(running, Signature(False, team, True)) == (
        "its code signature is broken"
    )
    assert signature_problem(running, Signature(True, team, False)) == (
        "it carries no notarization ticket"
    )
    # An ad-hoc running app leaves the decision to the published SHA-256.
    assert signature_problem(Signature(True, None, False), Signature(True, None, False)) is None


def test_an_app_needing_a_newer_macos_is_refused():
    assert macos_problem("15.0", "14.7.1") == "needs macOS 15.0; this Mac has 14.7.1"
    assert macos_problem("14.0", "26.1") is None
    assert macos_problem("14.0", None) is None  # not a Mac
    assert macos_problem("", "14.0") is None  # the app names no minimum
