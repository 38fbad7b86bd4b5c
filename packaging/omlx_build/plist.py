"""Info.plist for omlx.app: written by py2app on a Mac, checkable anywhere with plistlib."""

from __future__ import annotations

import re
from typing import Any

from omlx_build.project import BundleConfig

REQUIRED = (
    "CFBundleName",
    "CFBundleDisplayName",
    "CFBundleIdentifier",
    "CFBundleShortVersionString",
    "CFBundleVersion",
    "CFBundleExecutable",
    "CFBundleIconFile",
    "CFBundlePackageType",
    "LSMinimumSystemVersion",
    "LSUIElement",
    "LSArchitecturePriority",
    "NSHighResolutionCapable",
)


def info_plist(config: BundleConfig) -> dict[str, Any]:
    feed = {"OMLXUpdateFeed": config.update_feed} if config.update_feed else {}
    return {
        **feed,
        "CFBundleName": config.name,
        "CFBundleDisplayName": config.name,
        "CFBundleIdentifier": config.bundle_id,
        "CFBundleShortVersionString": config.version,
        "CFBundleVersion": config.version,
        "CFBundleExecutable": config.name,
        "CFBundleIconFile": config.icon.name,
        "CFBundlePackageType": "APPL",
        "CFBundleInfoDictionaryVersion": "6.0",
        "LSMinimumSystemVersion": config.minimum_macos,
        # Menu-bar app: no Dock icon, no main menu.
        "LSUIElement": True,
        "LSArchitecturePriority": [config.arch],
        "LSApplicationCategoryType": "public.app-category.developer-tools",
        "NSHighResolutionCapable": True,
        "NSHumanReadableCopyright": config.copyright,
        # The admin window loads http://127.0.0.1; ATS allows local networking with this.
        "NSAppTransportSecurity": {"NSAllowsLocalNetworking": True},
    }


def plist_problems(plist: dict[str, Any], config: BundleConfig) -> list[str]:
    """What is wrong with ``plist`` for this config (empty when it is right)."""
    problems = [f"Info.plist lacks {key}" for key in REQUIRED if key not in plist]
    expect = {
        "CFBundleIdentifier": config.bundle_id,
        "CFBundleShortVersionString": config.version,
        "LSUIElement": True,
        "LSMinimumSystemVersion": config.minimum_macos,
        "LSArchitecturePriority": [config.arch],
        "CFBundleIconFile": config.icon.name,
    }
    for key, want in expect.items():
        if key in plist and plist[key] != want:
            problems.append(f"Info.plist {key} is {plist[key]!r}, expected {want!r}")
    if not re.fullmatch(r"[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+", str(plist.get("CFBundleIdentifier"))):
        problems.append("CFBundleIdentifier is not a reverse-DNS name")
    if not re.fullmatch(r"\d+(\.\d+){0,2}", str(plist.get("CFBundleShortVersionString"))):
        problems.append("CFBundleShortVersionString must be up to three integers (x.y.z)")
    return problems
