"""`omlx launch claude|codex|opencode`: each tool starts with settings that reach
this server. The tools themselves are not installed here, so a stand-in on PATH
reads its settings the way the tool does (Claude Code's environment, Codex's `-c`
TOML overrides, opencode's inline JSON config) and talks to the live server with
the official SDK the tool's wire protocol matches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from tests.fixtures.servers import live_server

ROOT = Path(__file__).resolve().parents[2]
KEY = "launch-test-key"

CLAUDE = """
import anthropic, json, os, sys
# Claude Code's settings: ANTHROPIC_BASE_URL, ANTHROPIC_AUTH_TOKEN (Bearer), ANTHROPIC_MODEL.
client = anthropic.Anthropic(max_retries=0)
reply = client.messages.create(
    model=os.environ["ANTHROPIC_MODEL"], max_tokens=4,
    messages=[{"role": "user", "content": "hi"}])
"""

CODEX = """
import json, os, sys, tomllib, openai
args, config, i = sys.argv[1:], {}, 0
while i < len(args):
    if args[i] == "-c":  # Codex parses each override's value as TOML
        key, value = args[i + 1].split("=", 1)
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = tomllib.loads("v = " + value)["v"]
        i += 2
    elif args[i] == "-m":
        config["model"] = args[i + 1]
        i += 2
    else:
        i += 1
provider = config["model_providers"][config["model_provider"]]
assert provider["wire_api"] == "responses", provider
client = openai.OpenAI(base_url=provider["base_url"], api_key=os.environ[provider["env_key"]],
                       max_retries=0)
reply = client.responses.create(model=config["model"], input="hi", max_output_tokens=4)
"""

OPENCODE = """
import json, os, sys, openai
config = json.loads(os.environ["OPENCODE_CONFIG_CONTENT"])
provider_id, model = config["model"].split("/", 1)
provider = config["provider"][provider_id]
assert provider["npm"] == "@ai-sdk/openai-compatible" and model in provider["models"]
key = provider["options"]["apiKey"]
if key.startswith("{env:"):  # opencode's variable substitution
    key = os.environ[key[5:-1]]
client = openai.OpenAI(base_url=provider["options"]["baseURL"], api_key=key, max_retries=0)
reply = client.chat.completions.create(
    model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
"""

RECORD = """
with open(os.environ["LAUNCH_RECORD"], "w") as out:
    json.dump({"argv": sys.argv[1:], "reply": reply.model_dump(mode="json")}, out)
"""


@pytest.fixture(scope="module")
def server(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with live_server(
        tmp_path_factory.mktemp("base"),
        tiny_models_dir,
        server={"api_key": KEY},
        models={"default_model": "tiny-qwen3"},
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tools")
    for name, body in (("claude", CLAUDE), ("codex", CODEX), ("opencode", OPENCODE)):
        script = folder / name
        script.write_text(f"#!{sys.executable}\n{body}\n{RECORD}")
        script.chmod(0o755)
    return folder


def launch(
    *args: str, server: Server, base: Path, path: str, record: Path | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": path,
        "OMLX_SERVER__PORT": str(server.settings.server.port),
        "OMLX_SERVER__API_KEY": KEY,
        "LAUNCH_RECORD": str(record or base / "record.json"),
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        [sys.executable, "-m", "omlx.cli", "--base-path", str(base), "launch", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("tool", ["claude", "codex", "opencode"])
def test_launched_tool_reaches_the_server_with_its_model(
    tool: str, server: Server, tools_dir: Path, tmp_path: Path
) -> None:
    path = f"{tools_dir}{os.pathsep}{os.environ['PATH']}"
    out = launch(tool, "--", "--extra", "arg", server=server, base=tmp_path, path=path)
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / "record.json").read_text())
    # The arguments after -- reach the tool, after the ones launch adds.
    assert record["argv"][-2:] == ["--extra", "arg"]
    reply = record["reply"]
    assert reply.get("model", reply.get("id")) == "tiny-qwen3"  # the server's default model


def test_model_flag_picks_another_model(server: Server, tools_dir: Path, tmp_path: Path) -> None:
    path = f"{tools_dir}{os.pathsep}{os.environ['PATH']}"
    out = launch("claude", "--model", "tiny-llama", server=server, base=tmp_path, path=path)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "record.json").read_text())["reply"]["model"] == "tiny-llama"


def test_unknown_model_names_the_served_ones(server: Server, tmp_path: Path) -> None:
    out = launch("codex", "--model", "nope", server=server, base=tmp_path, path="/usr/bin")
    assert out.returncode == 1
    assert "no model 'nope'" in out.stderr and "tiny-llama" in out.stderr


def test_missing_tool_says_how_to_install_it(server: Server, tmp_path: Path) -> None:
    out = launch("opencode", server=server, base=tmp_path, path="/nonexistent")
    assert out.returncode == 1
    assert "npm install -g opencode-ai" in out.stderr


def test_print_shows_the_settings_without_running(server: Server, tmp_path: Path) -> None:
    out = launch("claude", "--print", server=server, base=tmp_path, path="/nonexistent")
    assert out.returncode == 0, out.stderr
    port = server.settings.server.port
    assert f"export ANTHROPIC_BASE_URL=http://127.0.0.1:{port}" in out.stdout
    assert "export ANTHROPIC_MODEL=tiny-qwen3" in out.stdout
    # The model's window, for Claude Code's own compaction; and the warning that a
    # 4k window cannot hold what Claude Code sends first (recorded: ~12k tokens).
    assert "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=4096" in out.stdout
    assert "omlx: warning: Claude Code's first request alone is about" in out.stderr
    assert "every request will be refused" in out.stderr


def test_server_not_running_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "OMLX_SERVER__PORT": "9", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "omlx.cli", "--base-path", str(tmp_path), "launch", "claude"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 1
    assert "omlx is not running at http://127.0.0.1:9" in out.stderr


def test_admin_connect_route_never_shows_the_key(server: Server) -> None:
    reply = httpx.get(
        server.base_url + "/admin/api/connect",
        params={"model": "tiny-llama"},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert KEY not in reply.text
    claude = next(t for t in data["tools"] if t["tool"] == "claude")
    assert claude["env"]["ANTHROPIC_BASE_URL"] == server.base_url
    assert claude["env"]["ANTHROPIC_MODEL"] == "tiny-llama"
    assert data["context_window"] == 4096
    assert "'tiny-llama' has a context window of 4,096 tokens" in claude["warning"]
    missing = httpx.get(
        server.base_url + "/admin/api/connect",
        params={"model": "nope"},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert missing.status_code == 404
