"""Settings precedence, validation messages, the settings file and the config CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from omlx.cli import main
from omlx.errors import SettingsError
from omlx.settings import load_settings, set_file_value


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty base path in OMLX_BASE_PATH and no other OMLX_* variables."""
    for name in list(os.environ):
        if name.upper().startswith("OMLX_"):
            monkeypatch.delenv(name)
    folder = tmp_path / "base"
    folder.mkdir()
    monkeypatch.setenv("OMLX_BASE_PATH", str(folder))
    return folder


def write_settings(folder: Path, data: dict) -> Path:
    path = folder / "settings.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# ---- defaults and base path -------------------------------------------------------


def test_defaults(base):
    settings = load_settings()

    assert settings.server.host == "127.0.0.1"
    assert settings.server.port == 8000
    assert settings.scheduler.max_concurrent_requests == 8
    assert settings.base_path == base
    assert settings.model_dirs == [base / "models"]
    assert settings.settings_path == base / "settings.json"


def test_base_path_from_env_reads_its_settings_file(base):
    write_settings(base, {"server": {"port": 9100}})

    assert load_settings().server.port == 9100


def test_cli_base_path_beats_env(base, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    write_settings(base, {"server": {"port": 9100}})
    write_settings(other, {"server": {"port": 9200}})

    settings = load_settings({"base_path": str(other)})

    assert settings.base_path == other
    assert settings.server.port == 9200
    assert settings.model_dirs == [other / "models"]


def test_base_path_in_the_file_is_ignored(base, tmp_path):
    write_settings(base, {"base_path": str(tmp_path / "elsewhere")})

    assert load_settings().base_path == base


def test_explicit_model_dirs_replace_the_default(base, tmp_path):
    write_settings(base, {"models": {"model_dirs": [str(tmp_path / "a"), str(tmp_path / "b")]}})

    assert load_settings().model_dirs == [tmp_path / "a", tmp_path / "b"]


# ---- precedence ---------------------------------------------------------------------

FIELDS = [
    # group, field, env name, file value, env value, cli value
    ("server", "port", "OMLX_SERVER__PORT", 7000, "7100", 7200),
    (
        "scheduler",
        "max_concurrent_requests",
        "OMLX_SCHEDULER__MAX_CONCURRENT_REQUESTS",
        3,
        "4",
        5,
    ),
    ("generation", "max_tokens", "OMLX_GENERATION__MAX_TOKENS", 100, "200", 300),
]


@pytest.mark.parametrize(("group", "field", "env", "in_file", "in_env", "in_cli"), FIELDS)
def test_precedence_cli_over_env_over_file_over_default(
    base, monkeypatch, group, field, env, in_file, in_env, in_cli
):
    def value(cli=None):
        return getattr(getattr(load_settings(cli), group), field)

    default = value()
    write_settings(base, {group: {field: in_file}})
    assert value() == in_file != default

    monkeypatch.setenv(env, in_env)
    assert value() == int(in_env)

    assert value({group: {field: in_cli}}) == in_cli


def test_sources_merge_field_by_field_within_a_group(base, monkeypatch):
    write_settings(base, {"server": {"host": "0.0.0.0", "port": 7000}})
    monkeypatch.setenv("OMLX_SERVER__PORT", "7100")

    settings = load_settings({"server": {"log_level": "debug"}})

    assert (settings.server.host, settings.server.port, settings.server.log_level) == (
        "0.0.0.0",
        7100,
        "debug",
    )


def test_transient_margin_defaults_to_auto_and_a_saved_size_still_pins_it(base):
    assert load_settings().memory.prefill_transient_margin == "auto"
    # A settings file from before "auto" existed keeps its size.
    write_settings(base, {"memory": {"prefill_transient_margin": "1GB"}})
    assert load_settings().memory.prefill_transient_margin == "1GB"
    write_settings(base, {"memory": {"prefill_transient_margin": "lots"}})
    with pytest.raises(SettingsError, match="prefill_transient_margin"):
        load_settings()


# ---- validation -----------------------------------------------------------------------


def test_invalid_value_in_file_names_the_field(base):
    write_settings(base, {"server": {"port": 70000}})

    with pytest.raises(SettingsError, match=r"'server\.port'"):
        load_settings()


def test_invalid_value_in_env_names_the_field(base, monkeypatch):
    monkeypatch.setenv("OMLX_SERVER__PORT", "not-a-port")

    with pytest.raises(SettingsError, match=r"'server\.port'.*not-a-port"):
        load_settings()


def test_invalid_value_from_cli_names_the_field(base):
    with pytest.raises(SettingsError, match=r"'scheduler\.max_concurrent_requests'"):
        load_settings({"scheduler": {"max_concurrent_requests": 0}})


def test_error_names_every_invalid_field(base):
    write_settings(base, {"server": {"port": 0}, "sampling": {"temperature": 5}})

    with pytest.raises(SettingsError) as info:
        load_settings()

    assert "'server.port'" in info.value.message
    assert "'sampling.temperature'" in info.value.message


@pytest.mark.parametrize(
    ("data", "name"),
    [({"server": {"prot": 8000}}, "server.prot"), ({"nonsense": 1}, "nonsense")],
)
def test_unknown_key_in_file_is_named(base, data, name):
    write_settings(base, data)

    with pytest.raises(SettingsError, match=rf"'{name}': unknown setting"):
        load_settings()


def test_invalid_json_names_the_file_and_line(base):
    path = base / "settings.json"
    path.write_text('{\n  "server": {\n    "port": 8000,\n  }\n}\n', encoding="utf-8")

    with pytest.raises(SettingsError) as info:
        load_settings()

    assert str(path) in info.value.message
    assert "line 4" in info.value.message


def test_file_must_hold_an_object(base):
    path = base / "settings.json"
    path.write_text("[1, 2]", encoding="utf-8")

    with pytest.raises(SettingsError, match="must hold a JSON object") as info:
        load_settings()
    assert str(path) in info.value.message


# ---- set_file_value ----------------------------------------------------------------------


def test_set_file_value_writes_complete_json_and_keeps_other_keys(base):
    write_settings(base, {"server": {"host": "0.0.0.0"}, "scheduler": {"prefill_step_size": 64}})

    set_file_value(base, "server.port", 9001)

    assert json.loads((base / "settings.json").read_text(encoding="utf-8")) == {
        "server": {"host": "0.0.0.0", "port": 9001},
        "scheduler": {"prefill_step_size": 64},
    }
    assert sorted(p.name for p in base.iterdir()) == ["settings.json"]
    assert load_settings().server.port == 9001


def test_set_file_value_creates_the_base_folder(tmp_path):
    folder = tmp_path / "new" / "base"

    set_file_value(folder, "models.default_model", "tiny")

    assert json.loads((folder / "settings.json").read_text()) == {
        "models": {"default_model": "tiny"}
    }


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("server.port", 70000, "server.port"),
        ("server.prot", 1, "server.prot"),
        ("sampling.top_p", 0, "sampling.top_p"),
    ],
)
def test_set_file_value_rejects_invalid_and_leaves_the_file_unchanged(base, key, value, named):
    path = write_settings(base, {"server": {"port": 8123}})
    before = path.read_bytes()

    with pytest.raises(SettingsError, match=rf"'{named}'"):
        set_file_value(base, key, value)

    assert path.read_bytes() == before
    assert sorted(p.name for p in base.iterdir()) == ["settings.json"]


def test_set_file_value_failing_mid_write_keeps_old_file_and_no_temp(base, monkeypatch):
    path = write_settings(base, {"server": {"port": 8123}})
    before = path.read_bytes()

    def broken_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        set_file_value(base, "server.port", 9001)

    assert path.read_bytes() == before
    assert sorted(p.name for p in base.iterdir()) == ["settings.json"]


# ---- the config CLI ------------------------------------------------------------------------


def test_cli_config_show_prints_effective_settings(base, capsys):
    write_settings(base, {"server": {"port": 9300}})

    assert main(["--base-path", str(base), "config", "show"]) == 0

    shown = json.loads(capsys.readouterr().out)
    assert shown["server"]["port"] == 9300
    assert shown["scheduler"]["max_concurrent_requests"] == 8


def test_cli_reports_bad_file_value_with_exit_code_2(base, capsys):
    write_settings(base, {"server": {"port": 70000}})

    assert main(["--base-path", str(base), "config", "show"]) == 2

    captured = capsys.readouterr()
    assert "'server.port'" in captured.err
    assert captured.out == ""


def test_cli_reports_bad_env_value_with_exit_code_2(base, monkeypatch, capsys):
    monkeypatch.setenv("OMLX_SCHEDULER__MAX_CONCURRENT_REQUESTS", "1000")

    assert main(["config", "show"]) == 2

    assert "'scheduler.max_concurrent_requests'" in capsys.readouterr().err


def test_cli_config_set_rejects_invalid_value(base, capsys):
    path = write_settings(base, {"server": {"port": 8123}})
    before = path.read_bytes()

    assert main(["--base-path", str(base), "config", "set", "server.port", "70000"]) == 2

    assert "'server.port'" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_cli_config_set_writes_json_values_and_plain_strings(base):
    assert main(["--base-path", str(base), "config", "set", "server.port", "9001"]) == 0
    assert main(["--base-path", str(base), "config", "set", "server.host", "0.0.0.0"]) == 0

    assert json.loads((base / "settings.json").read_text()) == {
        "server": {"host": "0.0.0.0", "port": 9001}
    }


def test_set_file_value_validates_the_file_alone_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMLX_SERVER__PORT", "not-a-port")
    set_file_value(tmp_path, "server.host", "0.0.0.0")
    assert json.loads((tmp_path / "settings.json").read_text()) == {"server": {"host": "0.0.0.0"}}
