"""Security settings the admin API may change only for a request that proves the key.

One request from a web page (DNS rebinding, a stray local tool) must not be able to
open the server to the network, swap its key, point it at other folders or let
other origins in. So these settings change over HTTP only when an API key is set
and the request carries it (header or login session); ``allow_unauthenticated_remote``
never does. The command line and the settings file can always change them.
Per-model settings hold no paths, and their chat_template_kwargs are template variables
only (``omlx.template_vars``), so none of them needs this gate.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omlx.errors import ProtectedSettingError

PROTECTED_SETTINGS = (
    "server.host",
    "server.allow_unauthenticated_remote",
    "server.api_key",
    "server.web_dir",
    "server.cors_origins",
    "server.allowed_hosts",
    "models.model_dirs",
    # The Hub downloads come from, and the hf_token is sent to: a page must not redirect it.
    "models.hf_endpoint",
    # Hosts the server fetches image URLs from on a request's word: a page must not add any.
    "models.image_url_allowlist",
    "cache.ssd_cache_dir",
    # Where the app downloads its own updates from: for an ad-hoc build the feed's
    # SHA-256 is the only check, so a page must not point it elsewhere.
    "app.update_feed",
)
# Opening the server to the network without a key is a decision for the machine's owner.
NEVER_OVER_HTTP = frozenset({"server.allow_unauthenticated_remote"})

PROTECTED_REASON = (
    "Security settings change here only when an API key is set and you are logged in; "
    "otherwise use `omlx config set KEY VALUE` or edit settings.json, then restart."
)


def _locked_reason(key: str) -> str:
    """Why the panel shows ``key`` read-only, and how to change it instead (one line)."""
    if key in NEVER_OVER_HTTP:
        return f"Never changed over HTTP: run `omlx config set {key} true`."
    return f"Needs an API key and login to change here; or run `omlx config set {key} VALUE`."


def _how_to_change(keys: list[str], settings_path: Path) -> str:
    example = f"`omlx config set {keys[0]} VALUE`"
    them = "it" if len(keys) == 1 else "them"
    return f"change {them} with {example} or in {settings_path}, then restart the server"


def check_settings_change(keys: Iterable[str], *, authenticated: bool, settings_path: Path) -> None:
    """Raise ProtectedSettingError (naming every refused key) if any may not change."""
    keys = list(keys)
    never = [k for k in keys if k in NEVER_OVER_HTTP]
    if never:
        raise ProtectedSettingError(
            f"'{never[0]}' cannot be changed over HTTP, even with the API key: "
            + _how_to_change(never, settings_path),
            param=never[0],
        )
    refused = [k for k in keys if k in PROTECTED_SETTINGS]
    if refused and not authenticated:
        named = ", ".join(f"'{k}'" for k in refused)
        raise ProtectedSettingError(
            f"{named}: security setting{'s' if len(refused) > 1 else ''} that change over HTTP "
            "only when an API key is set and the request sends it (or a login session); "
            + _how_to_change(refused, settings_path)
            + ", or set server.api_key that way and log in",
            param=refused[0],
        )


def describe(*, authenticated: bool) -> dict[str, Any]:
    """What GET /admin/api/settings tells the panel about protected settings."""
    locked = [k for k in PROTECTED_SETTINGS if k in NEVER_OVER_HTTP or not authenticated]
    return {
        "protected": list(PROTECTED_SETTINGS),
        "never_over_http": sorted(NEVER_OVER_HTTP),
        "protected_reason": PROTECTED_REASON,
        # Whether this request could change the protected ones (never_over_http aside).
        "can_change_protected": authenticated,
        # Read-only for this request, each with the reason and the way to change it.
        "locked": {k: _locked_reason(k) for k in locked},
    }
