"""Updates: check the feed, download the DMG, verify the app in it, swap it in, relaunch.

`check` makes no network call when the feed is unset, or when the machine is offline
and the feed is not on this machine. `prepare` downloads and verifies while the server
still runs and touches nothing of the installed app: a refused or failed update leaves
it as it was. `swap` (after the caller stopped the server) renames the old app aside and
moves the new one in; on failure the old one is put back. The old one is deleted by
`remove_leftovers` once the new app runs. The system tools are behind
`app.platform_calls`, so the tests run these same steps on Linux.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import ipaddress
import logging
import os
import plistlib
import socket
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
from packaging.version import InvalidVersion, Version

from app.login_item import refusal
from app.platform_calls import PlatformCallError, PlatformCalls, Signature, remove_tree
from app.update_feed import FeedError, Release, is_newer, parse_feed

log = logging.getLogger("omlx.app")

MAX_FEED_BYTES = 1 << 20
CHUNK_BYTES = 1 << 20
MAX_DMG_BYTES = 8 << 30  # the app's DMG is ~200 MB; a feed must not fill the disk


class UpdateError(Exception):
    """The update was refused or failed; the installed app is unchanged."""


class Outcome(enum.Enum):
    DISABLED = "disabled"  # no feed set: nothing was asked
    OFFLINE = "offline"  # no network: nothing was asked
    UP_TO_DATE = "up to date"
    AVAILABLE = "available"
    UNREACHABLE = "unreachable"  # no answer, an HTTP error or a malformed feed


@dataclass(frozen=True, slots=True)
class CheckResult:
    outcome: Outcome
    release: Release | None = None
    detail: str = ""

    def message(self, current: str) -> str:
        """What the menu says after Check for Updates…"""
        if self.outcome is Outcome.AVAILABLE and self.release is not None:
            return f"omlx {self.release.version} is available (you have {current})"
        if self.outcome is Outcome.UP_TO_DATE:
            return f"You're up to date: omlx {current} is the newest version"
        if self.outcome is Outcome.DISABLED:
            return "Update checks are off (the app.update_feed setting is empty)"
        if self.outcome is Outcome.OFFLINE:
            return "Can't reach the update server: this Mac is offline"
        return f"Can't reach the update server: {self.detail}"


def is_online() -> bool:
    """Whether any network interface besides loopback is up with a routable address."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if name not in stats or not stats[name].isup:
            continue
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6) and _routable(addr.address):
                return True
    return False


def _routable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local)


def _is_local(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def signature_problem(running: Signature, new: Signature) -> str | None:
    """Why the new app's signature does not match the running one's (None: it does)."""
    if running.team_id is None:
        return None  # ad hoc: the published SHA-256 vouches for it instead
    if not new.valid:
        return "its code signature is broken"
    if new.team_id != running.team_id:
        return f"it is signed by team {new.team_id or 'none (ad hoc)'}, not {running.team_id}"
    if running.notarized and not new.notarized:
        return "it carries no notarization ticket"
    return None


def macos_problem(needed: str, have: str | None) -> str | None:
    """Why an app that needs macOS ``needed`` cannot run on ``have`` (None: it can)."""
    if not needed or have is None:
        return None
    try:
        too_old = Version(have) < Version(needed)
    except InvalidVersion:
        return None
    return f"needs macOS {needed}; this Mac has {have}" if too_old else None


def bundle_info(app: Path) -> dict[str, object]:
    try:
        info = plistlib.loads((app / "Contents" / "Info.plist").read_bytes())
    except (OSError, plistlib.InvalidFileException) as exc:
        raise UpdateError(f"{app.name} has no readable Info.plist ({exc})") from None
    return info if isinstance(info, dict) else {}


class Updater:
    """Updates ``installed_app`` (None when running from source: check only)."""

    def __init__(
        self,
        feed_url: str,
        current_version: str,
        installed_app: Path | None,
        calls: PlatformCalls,
        *,
        online: Callable[[], bool] = is_online,
        timeout_s: float = 30.0,
    ):
        self.feed_url = feed_url.strip()
        self.current_version = current_version
        self.installed_app = installed_app
        self.calls = calls
        self._online = online
        self._timeout_s = timeout_s

    # -- check ----------------------------------------------------------------------------

    def check(self) -> CheckResult:
        if not self.feed_url:
            return CheckResult(Outcome.DISABLED)
        if not _is_local(self.feed_url) and not self._online():
            return CheckResult(Outcome.OFFLINE)
        try:
            release = parse_feed(self._fetch_feed(), self.feed_url)
        except (httpx.HTTPError, httpx.InvalidURL, FeedError) as exc:
            log.info("update check: %s", exc)
            return CheckResult(Outcome.UNREACHABLE, detail=_describe(exc, self.feed_url))
        if is_newer(release, self.current_version):
            return CheckResult(Outcome.AVAILABLE, release)
        return CheckResult(Outcome.UP_TO_DATE, release)

    def _fetch_feed(self) -> bytes:
        with httpx.stream(
            "GET", self.feed_url, timeout=self._timeout_s, follow_redirects=True
        ) as resp:
            resp.raise_for_status()
            body = b""
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_FEED_BYTES:
                    raise FeedError(f"the update feed at {self.feed_url} is over 1 MiB")
            return body

    # -- prepare: download and verify, the installed app untouched -----------------------

    def prepare(self, release: Release) -> Path:
        """The new app, verified, staged beside the installed one; UpdateError if refused."""
        installed = self._installed()
        running = self.calls.signature(installed)
        if running.team_id is None and release.sha256 is None:
            raise UpdateError(
                "the update feed gives no SHA-256 for this ad-hoc-signed build, so the "
                "download cannot be verified; download the new version by hand"
            )
        staging = installed.parent / f".omlx-update-{uuid.uuid4().hex[:8]}"
        try:
            staging.mkdir()
        except OSError as exc:
            raise UpdateError(f"cannot write to {installed.parent} ({exc.strerror})") from None
        try:
            with tempfile.TemporaryDirectory(prefix="omlx-download-") as tmp:
                dmg = self._download(release, Path(tmp) / "update.dmg")
                staged = self._stage(dmg, staging / installed.name)
            self._verify_app(staged, release, running)
            return staged
        except BaseException:
            remove_tree(staging)
            raise

    def _installed(self) -> Path:
        installed = self.installed_app
        if installed is None:
            raise UpdateError("this omlx runs from source: updates install into omlx.app only")
        why = refusal(installed)
        if why:
            raise UpdateError(f"{why}, then update")
        return installed

    def _download(self, release: Release, dest: Path) -> Path:
        digest = hashlib.sha256()
        try:
            with httpx.stream(
                "GET", release.dmg_url, timeout=self._timeout_s, follow_redirects=True
            ) as resp, dest.open("wb") as out:  # fmt: skip
                resp.raise_for_status()
                for chunk in resp.iter_bytes(CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
                    if out.tell() > MAX_DMG_BYTES:
                        raise UpdateError(f"the download is over {MAX_DMG_BYTES >> 30} GiB")
        except httpx.HTTPError as exc:
            raise UpdateError(f"the download failed: {_describe(exc, release.dmg_url)}") from None
        got = digest.hexdigest()
        if release.sha256 is not None and got != release.sha256:
            raise UpdateError(
                f"the downloaded disk image's SHA-256 is {got}, not the {release.sha256} "
                "the update feed publishes: it was changed or damaged; nothing was installed"
            )
        return dest

    def _stage(self, dmg: Path, dest: Path) -> Path:
        try:
            with self.calls.attach(dmg) as volume:
                found = volume / dest.name
                if not (found / "Contents" / "Info.plist").is_file():
                    raise UpdateError(f"the disk image holds no {dest.name}")
                self.calls.copy_app(found, dest)
        except PlatformCallError as exc:
            raise UpdateError(f"cannot open the disk image: {exc}") from None
        return dest

    def _verify_app(self, staged: Path, release: Release, running: Signature) -> None:
        assert self.installed_app is not None
        new_info, old_info = bundle_info(staged), bundle_info(self.installed_app)
        if new_info.get("CFBundleIdentifier") != old_info.get("CFBundleIdentifier"):
            raise UpdateError(
                f"the disk image's app is {new_info.get('CFBundleIdentifier')!r}, "
                f"not {old_info.get('CFBundleIdentifier')!r}"
            )
        version = new_info.get("CFBundleShortVersionString")
        if version != release.version:
            raise UpdateError(f"the disk image holds omlx {version}, not {release.version}")
        needed = str(new_info.get("LSMinimumSystemVersion") or "")
        problem = macos_problem(needed, self.calls.macos_version())
        if problem:
            raise UpdateError(f"omlx {version} {problem}")
        problem = signature_problem(running, self.calls.signature(staged))
        if problem:
            raise UpdateError(f"the new app was refused: {problem}")

    # -- swap and relaunch (the server stopped) -------------------------------------------

    def swap(self, staged: Path) -> Path:
        """Put ``staged`` where the installed app is; the old one comes back on failure."""
        installed = self._installed()
        aside = installed.with_name(f".{installed.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(installed, aside)
        except OSError as exc:
            remove_tree(staged.parent)
            raise UpdateError(f"cannot move {installed} aside ({exc.strerror})") from None
        try:
            os.rename(staged, installed)
        except OSError as exc:
            os.rename(aside, installed)
            remove_tree(staged.parent)
            raise UpdateError(f"cannot move the new app into place ({exc.strerror})") from None
        with contextlib.suppress(OSError):  # empty now; remove_leftovers retries
            staged.parent.rmdir()
        # The old app stays aside until the new one starts: this process still runs from
        # it and may import a module or two before it quits.
        return installed

    def remove_leftovers(self) -> list[Path]:
        """Delete old apps and staging folders earlier updates left; returns them."""
        if self.installed_app is None:
            return []
        name = self.installed_app.name
        found = [
            *self.installed_app.parent.glob(f".{name}.old-*"),
            *self.installed_app.parent.glob(".omlx-update-*"),
        ]
        for leftover in found:
            try:
                remove_tree(leftover)
            except OSError as exc:  # the update is in place; a leftover only costs space
                log.warning("update: could not remove %s: %s", leftover, exc)
        return found

    def relaunch(self) -> None:
        self.calls.relaunch(self._installed())


def _describe(exc: Exception, url: str) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{url} answered HTTP {exc.response.status_code}"
    if isinstance(exc, httpx.TimeoutException):
        return f"{url} did not answer in time"
    if isinstance(exc, httpx.HTTPError):
        return f"no connection to {urlparse(url).netloc} ({type(exc).__name__})"
    return str(exc)
