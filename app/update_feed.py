"""The release feed the app checks for updates: pure parsing and version comparison.

The feed is one JSON object, published next to each release's disk image::

    {"version": "0.2.0", "url": "omlx-0.2.0.dmg",
     "sha256": "<hex digest of the DMG>", "notes": "What changed"}

``url`` may be relative to the feed's own URL. ``sha256`` is required to install an
ad-hoc-signed build (nothing else vouches for it); a Developer ID build is checked by its
signature's team identifier and notarization staple, and by ``sha256`` too when given.
A release writes its feed with ``python -m app.update_feed DMG VERSION [NOTES] > FEED``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlparse

from packaging.version import InvalidVersion, Version

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class FeedError(Exception):
    """The feed could not be read as a release; the message says what is wrong with it."""


@dataclass(frozen=True, slots=True)
class Release:
    version: str
    dmg_url: str
    sha256: str | None = None
    notes: str = ""


def parse_feed(body: bytes, feed_url: str) -> Release:
    """The release a feed announces; FeedError (naming the field) if it is malformed."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FeedError(f"the update feed at {feed_url} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FeedError(f"the update feed at {feed_url} must be a JSON object")
    version = _text(data, "version", feed_url)
    _parse_version(version, f"the update feed's version {version!r}")
    dmg_url = urljoin(feed_url, _text(data, "url", feed_url))
    if urlparse(dmg_url).scheme not in ("http", "https"):
        raise FeedError(f"the update feed's url {dmg_url!r} is not http(s)")
    sha256 = data.get("sha256")
    if sha256 is not None:
        sha256 = str(sha256).strip().lower()
        if not _SHA256.match(sha256):
            raise FeedError(f"the update feed's sha256 {data['sha256']!r} is not 64 hex digits")
    notes = data.get("notes")
    return Release(version, dmg_url, sha256, notes if isinstance(notes, str) else "")


def _text(data: dict[str, Any], key: str, feed_url: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value.strip():
        raise FeedError(f"the update feed at {feed_url} has no {key!r}")
    return value.strip()


def _parse_version(text: str, what: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise FeedError(f"{what} is not a version number") from None


def is_newer(release: Release, current: str) -> bool:
    """True when ``release`` is a later version than the running ``current``."""
    try:
        running = Version(current)
    except InvalidVersion:
        return True  # a running version we cannot read is never "up to date"
    return _parse_version(release.version, "the release") > running


def feed_json(dmg: Path, version: str, notes: str = "") -> str:
    """The feed for ``dmg`` published beside it (its url relative, its SHA-256)."""
    _parse_version(version, f"version {version!r}")
    digest = hashlib.sha256()
    with dmg.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    feed = {"version": version, "url": dmg.name, "sha256": digest.hexdigest(), "notes": notes}
    return json.dumps(feed, indent=2) + "\n"


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m app.update_feed DMG VERSION [NOTES] > omlx-update.json")
    try:
        sys.stdout.write(feed_json(Path(sys.argv[1]), sys.argv[2], *sys.argv[3:]))
    except (FeedError, OSError) as exc:
        sys.exit(f"update feed: {exc}")
