"""Backend URLs and per-backend keys, as the command line gives them."""

from __future__ import annotations

import argparse

import pytest

from omlx.errors import SettingsError
from omlx.router.config import build_backends, parse_backend_keys
from omlx.router.console import add_router_parser, config_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["router", *argv])


def test_urls_are_normalised_and_keys_attached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMLX_ROUTER_BACKEND_KEYS", raising=False)
    monkeypatch.setenv("OMLX_ROUTER_API_KEY", "from-env")
    args = parse(
        "--backend", "http://10.0.0.2:8000/v1/",
        "--backend", "http://10.0.0.3:8000",
        "--backend-key", "http://10.0.0.3:8000/=sk-with=equals",
    )  # fmt: skip
    config = config_from_args(args)
    assert [b.url for b in config.backends] == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    assert [b.key for b in config.backends] == [None, "sk-with=equals"]
    assert config.api_key == "from-env"
    assert "sk-with" not in repr(config) and "from-env" not in repr(config)


def test_keys_from_the_environment() -> None:
    keys = parse_backend_keys([], '{"http://h:1/": "k1"}')
    assert keys == {"http://h:1": "k1"}
    assert parse_backend_keys(["http://h:1=k2"], '{"http://h:1": "k1"}') == {"http://h:1": "k2"}


@pytest.mark.parametrize(
    ("urls", "keys", "message"),
    [
        ([], {}, "at least one --backend"),
        (["localhost:8000"], {}, "http://HOST:PORT"),
        (["http://h:1/chat"], {}, "only scheme, host and port"),
        (["http://h:1", "http://h:1/"], {}, "given twice"),
        (["http://h:1"], {"http://h:2": "k"}, "not a --backend"),
    ],
)
def test_bad_backends_are_refused_with_the_reason(urls: list, keys: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        build_backends(urls, keys)


def test_a_key_without_url_is_refused() -> None:
    with pytest.raises(SettingsError, match="URL=KEY"):
        parse_backend_keys(["sk-only"], None)


def test_fanout_timeout_and_poll_interval_flags() -> None:
    assert config_from_args(parse("--backend", "http://h:1")).fanout_timeout_s == 120.0
    args = parse("--backend", "http://h:1", "--fanout-timeout", "30", "--poll-interval", "0.5")
    config = config_from_args(args)
    assert (config.fanout_timeout_s, config.poll_interval_s) == (30.0, 0.5)
    with pytest.raises(SettingsError, match="positive seconds"):
        config_from_args(parse("--backend", "http://h:1", "--fanout-timeout", "0"))
