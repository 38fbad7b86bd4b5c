"""`omlx pull`, `omlx models rm` and the Hub settings from the command line (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.servers import ROOT, free_port
from tests.fixtures.tiny_models import build_tiny_model

REPO = "mlx-community/tiny-llama"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    model = build_tiny_model(tmp_path_factory.mktemp("hub-src") / "tiny", "llama", seed=4)
    with FakeHub() as fake:
        fake.add_folder(REPO, model)
        fake.add_folder("someone/gated", model, gated=True)
        yield fake


def omlx(
    *args: str, base: Path, endpoint: str | None = None, token: str | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT")}
    env["HF_HOME"] = str(base / "hf-home")  # no token saved by `hf auth login` here
    if endpoint is not None:
        env["HF_ENDPOINT"] = endpoint
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "omlx.cli", "--base-path", str(base), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_pull_list_and_rm(hub: FakeHub, tmp_path: Path) -> None:
    pulled = omlx("pull", REPO, "--revision", "main", base=tmp_path, endpoint=hub.url)
    assert pulled.returncode == 0, pulled.stderr
    assert "tiny-llama" in omlx("models", "list", base=tmp_path).stdout
    assert (tmp_path / "models" / "tiny-llama" / "model.safetensors").is_file()
    removed = omlx("models", "rm", "tiny-llama", base=tmp_path)
    assert removed.returncode == 0 and "removed tiny-llama" in removed.stdout
    assert not (tmp_path / "models" / "tiny-llama").exists()
    missing = omlx("models", "rm", "tiny-llama", base=tmp_path)
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_pull_refusals_say_what_to_change(hub: FakeHub, tmp_path: Path) -> None:
    unknown = omlx("pull", "nobody/nothing", base=tmp_path, endpoint=hub.url)
    assert unknown.returncode == 1 and "no model repo 'nobody/nothing'" in unknown.stderr
    revision = omlx("pull", REPO, "--revision", "v9", base=tmp_path, endpoint=hub.url)
    assert revision.returncode == 1 and "revision" in revision.stderr
    unsafe = omlx("pull", REPO, "--name", "../up", base=tmp_path, endpoint=hub.url)
    assert unsafe.returncode == 1 and "'name'" in unsafe.stderr
    dead = omlx("pull", REPO, base=tmp_path, endpoint=f"http://127.0.0.1:{free_port()}")
    assert dead.returncode == 1
    assert "Hub unreachable: offline? set models.hf_endpoint (a mirror)" in dead.stderr
    assert "Traceback" not in unknown.stderr + revision.stderr + unsafe.stderr + dead.stderr
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_the_setting_wins_over_hf_endpoint(hub: FakeHub, tmp_path: Path) -> None:
    assert omlx("config", "set", "models.hf_endpoint", hub.url, base=tmp_path).returncode == 0
    dead = f"http://127.0.0.1:{free_port()}"
    pulled = omlx("pull", REPO, "--name", "via-setting", base=tmp_path, endpoint=dead)
    assert pulled.returncode == 0, pulled.stderr
    bad = omlx("config", "set", "models.hf_endpoint", "hub.example", base=tmp_path)
    assert bad.returncode == 2 and "models.hf_endpoint" in bad.stderr


def test_config_never_prints_the_hf_token(tmp_path: Path) -> None:
    written = omlx("config", "set", "models.hf_token", "hf_secret_77", base=tmp_path)
    assert written.returncode == 0 and "hf_secret_77" not in written.stdout
    shown = omlx("config", "show", base=tmp_path)
    assert shown.returncode == 0 and "hf_secret_77" not in shown.stdout
    assert '"hf_token": "***"' in shown.stdout


def test_gated_repo_takes_the_token_from_hf_token(hub: FakeHub, tmp_path: Path) -> None:
    refused = omlx("pull", "someone/gated", base=tmp_path, endpoint=hub.url)
    assert refused.returncode == 1
    assert "gated" in refused.stderr and "models.hf_token" in refused.stderr
    assert "HF_TOKEN" in refused.stderr
    pulled = omlx("pull", "someone/gated", base=tmp_path, endpoint=hub.url, token="hf_good_token")
    assert pulled.returncode == 0, pulled.stderr
    assert "hf_good_token" not in pulled.stdout + pulled.stderr
    assert (tmp_path / "models" / "gated" / "config.json").is_file()
    assert not (tmp_path / "models" / "gated" / ".cache").exists()  # a plain model folder
