"""The real coding agents (installed by ``./setup.sh test`` into .agents/, pinned in
setup.sh) against one live omlx serving the scripted model of
tests/fixtures/agent_models.py, each agent in a home of its own under tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from omlx.api.server import Server
from tests.fixtures.agent_models import CONTEXT_TOKENS, TOOL_COMMAND, build_agent_model
from tests.fixtures.servers import live_server

ROOT = Path(__file__).resolve().parents[2]
AGENTS = Path(os.environ.get("OMLX_AGENTS_DIR", ROOT / ".agents"))
NPM_BIN = AGENTS / "npm" / "node_modules" / ".bin"
MODEL = "scripted"
KEY = "matrix-test-key"
AGENT_TIMEOUT_S = 300

# The shell tool of each agent (names and arguments as their real requests declare
# them) and the arguments the scripted model calls it with.
DESCRIPTION = "Print a number"
CALLS = {
    "Bash": {"command": TOOL_COMMAND, "description": DESCRIPTION},  # Claude Code
    "exec_command": {"cmd": TOOL_COMMAND},  # Codex
    "bash": {"command": TOOL_COMMAND, "description": DESCRIPTION},  # opencode
    # Qwen Code: 0.24.4's one-shot shell settles on the child's 'exit' event, which can
    # come before its stdout is read ("Output: (empty)" on a busy machine); the sleep
    # lets the output arrive first.
    "run_shell_command": {"command": f"{TOOL_COMMAND}; sleep 1", "description": DESCRIPTION},
    "shell": {"command": TOOL_COMMAND},  # the Agents SDK script's function tool
}

# No telemetry, update checks or vendor logins from a test.
QUIET_ENV = {
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "NO_UPDATE_NOTIFIER": "1",
}


def agent_program(*parts: str) -> Path:
    """An installed agent's program; a clear failure (never a skip) when it is missing."""
    path = AGENTS.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"{path} is missing: ./setup.sh test installs the coding agents")
    return path


@dataclass(frozen=True, slots=True)
class AgentRun:
    """Runs one agent in its own home (HOME and XDG dirs under tmp_path)."""

    server: Server
    home: Path

    @property
    def workdir(self) -> Path:
        return self.home / "project"

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def env(self, **extra: str) -> dict[str, str]:
        home = str(self.home)
        env = {
            **os.environ,
            **QUIET_ENV,
            "HOME": home,
            "XDG_CONFIG_HOME": f"{home}/.config",
            "XDG_DATA_HOME": f"{home}/.local/share",
            "XDG_CACHE_HOME": f"{home}/.cache",
            "XDG_STATE_HOME": f"{home}/.local/state",
            "PATH": f"{NPM_BIN}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT),
        }
        return {**env, **extra}

    def run(self, argv: list[str | Path], **extra_env: str) -> subprocess.CompletedProcess:
        # PWD too: opencode takes its project folder from it, not from the cwd.
        env = self.env(PWD=str(self.workdir), **extra_env)
        command = [str(arg) for arg in argv]
        try:
            return subprocess.run(
                command,
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=AGENT_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as exc:
            said = f"stdout:\n{_tail(exc.stdout)}\nstderr:\n{_tail(exc.stderr)}"
            pytest.fail(f"{command[:6]} ran past {AGENT_TIMEOUT_S} s\n{said}")

    def launch(self, tool: str, *tool_args: str, **extra_env: str) -> subprocess.CompletedProcess:
        """``omlx launch TOOL -- ARGS`` as a user types it, with the server's key in
        omlx's settings (the launcher hands it to the tool)."""
        argv = [sys.executable, "-m", "omlx.cli", "--base-path", self.home / ".omlx"]
        argv += ["launch", tool, "--url", self.base_url, "--model", MODEL, "--", *tool_args]
        return self.run(argv, OMLX_SERVER__API_KEY=KEY, **extra_env)


def _tail(output: str | bytes | None) -> str:
    text = output.decode(errors="replace") if isinstance(output, bytes) else output or ""
    return text[-4000:]


@pytest.fixture(scope="session")
def scripted_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("agent-models")
    build_agent_model(root / MODEL, CALLS)
    return root


@pytest.fixture(scope="module")
def agent_server(
    scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The scripted model, behind a key."""
    with live_server(
        tmp_path_factory.mktemp("agent-server"),
        scripted_model_dir,
        server={"api_key": KEY},
        models={"default_model": MODEL},
        generation={"max_context_window": CONTEXT_TOKENS},
    ) as server:
        yield server


@pytest.fixture
def agent(agent_server: Server, tmp_path: Path) -> AgentRun:
    run = AgentRun(agent_server, tmp_path / "home")
    run.workdir.mkdir(parents=True)
    return run
