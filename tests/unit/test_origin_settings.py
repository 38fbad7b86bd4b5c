"""The settings behind the origin guard: ``server.allowed_hosts`` entries and
``server.cors_origins``, whose ``*`` is refused at start without a key."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx.errors import SettingsError
from omlx.settings import load_settings


def test_a_wildcard_cors_origin_without_a_key_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"server\.cors_origins '\*'.*server\.api_key"):
        load_settings({"base_path": str(tmp_path), "server": {"cors_origins": ["*"]}})
    opened = load_settings(
        {"base_path": str(tmp_path), "server": {"cors_origins": ["*"], "api_key": "k"}}
    )
    assert opened.server.cors_origins == ["*"]


@pytest.mark.parametrize("origin", ["http://localhost:3000/", "localhost:3000", "*.example.com"])
def test_a_cors_origin_must_be_scheme_host_port(tmp_path: Path, origin: str) -> None:
    with pytest.raises(SettingsError, match=r"server\.cors_origins.*scheme://host"):
        load_settings({"base_path": str(tmp_path), "server": {"cors_origins": [origin]}})


def test_allowed_hosts_are_normalised(tmp_path: Path) -> None:
    settings = load_settings(
        {"base_path": str(tmp_path), "server": {"allowed_hosts": ["MyMac.Local", "[::1]"]}}
    )
    assert settings.server.allowed_hosts == ["mymac.local", "::1"]


@pytest.mark.parametrize("host", ["http://mymac.local", "mymac.local:8000", "*", "a/b", ""])
def test_an_allowed_host_that_is_not_a_bare_name_is_refused(tmp_path: Path, host: str) -> None:
    with pytest.raises(SettingsError, match=r"server\.allowed_hosts.*not a host name"):
        load_settings({"base_path": str(tmp_path), "server": {"allowed_hosts": [host]}})
