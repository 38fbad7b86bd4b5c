"""How each coding agent is pointed at this server: ``omlx launch`` and the admin
panel's Connect page share these plans, so what the panel shows is what runs.

Pure: no MLX, no HTTP. Each tool reads its own settings:
- Claude Code: ``ANTHROPIC_BASE_URL`` + ``ANTHROPIC_AUTH_TOKEN`` (sent as a Bearer
  key, so it never asks to approve a key) and a model name per model tier;
- Codex CLI: ``-c`` config overrides (TOML values) naming a provider that speaks the
  Responses API and reads its key from ``OMLX_API_KEY``;
- opencode: a whole inline config in ``OPENCODE_CONFIG_CONTENT`` with an
  OpenAI-compatible provider.
Each is told the model's context window where it has a setting for it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

# Clients refuse an empty key; the server ignores any key when none is set.
NO_KEY_PLACEHOLDER = "omlx"
KEY_ENV = "OMLX_API_KEY"
# opencode's own default answer budget; a small window gets a quarter of it instead.
OPENCODE_OUTPUT = 32000


@dataclass(frozen=True, slots=True)
class Connection:
    """Where the server answers and what a tool should ask for."""

    base_url: str  # e.g. http://127.0.0.1:8000, no trailing slash
    api_key: str | None
    model: str
    # The model's context window (None: unknown), told to the tool so that its own
    # compaction starts before the window is full.
    context_window: int | None = None

    @property
    def key(self) -> str:
        return self.api_key or NO_KEY_PLACEHOLDER


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    tool: str
    program: str
    args: tuple[str, ...]
    env: dict[str, str]
    install_hint: str

    def shell_lines(self) -> list[str]:
        """The plan as shell lines to copy: exports, then the command."""
        exports = [f"export {name}={shlex.quote(value)}" for name, value in self.env.items()]
        return [*exports, shlex.join([self.program, *self.args])]


def _claude(conn: Connection) -> LaunchPlan:
    env = {
        "ANTHROPIC_BASE_URL": conn.base_url,
        "ANTHROPIC_AUTH_TOKEN": conn.key,
        "ANTHROPIC_MODEL": conn.model,
        # Claude Code picks a model per tier for its own side tasks (titles, summaries).
        "ANTHROPIC_DEFAULT_OPUS_MODEL": conn.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": conn.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": conn.model,
        "ANTHROPIC_SMALL_FAST_MODEL": conn.model,
        # No telemetry or update checks to Anthropic's servers from a local setup.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # Claude Code opens its system prompt with an attribution line whose hash
        # changes with each session's first message: a restarted session would share
        # no prefix with the last one, and recompute its ~12k-token system prompt and
        # tools. Off, the prefix cache serves them (benchmarks/README.md, agent_traffic).
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    }
    if conn.context_window is not None:
        # Claude Code's own setting for a model it does not know: without it, it
        # assumes a 200k-1M window and never compacts in time.
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(conn.context_window)
    return LaunchPlan("claude", "claude", (), env, "npm install -g @anthropic-ai/claude-code")


def _codex(conn: Connection) -> LaunchPlan:
    provider = {
        "name": "omlx",
        "base_url": f"{conn.base_url}/v1",
        "env_key": KEY_ENV,
        "wire_api": "responses",
    }
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in provider.items())
    args: tuple[str, ...] = (
        "-c",
        f"model_providers.omlx={{ {table} }}",
        "-c",
        'model_provider="omlx"',
        "-m",
        conn.model,
    )
    if conn.context_window is not None:
        args += ("-c", f"model_context_window={conn.context_window}")
    return LaunchPlan("codex", "codex", args, {KEY_ENV: conn.key}, "npm install -g @openai/codex")


def _opencode(conn: Connection) -> LaunchPlan:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "omlx": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "omlx",
                "options": {"baseURL": f"{conn.base_url}/v1", "apiKey": f"{{env:{KEY_ENV}}}"},
                "models": {conn.model: _opencode_model(conn)},
            }
        },
        "model": f"omlx/{conn.model}",
    }
    env = {KEY_ENV: conn.key, "OPENCODE_CONFIG_CONTENT": json.dumps(config)}
    return LaunchPlan("opencode", "opencode", (), env, "npm install -g opencode-ai")


def _opencode_model(conn: Connection) -> dict[str, Any]:
    model: dict[str, Any] = {"name": conn.model}
    if conn.context_window is not None:
        # opencode compacts by limit.context and asks limit.output per answer.
        output = min(OPENCODE_OUTPUT, conn.context_window // 4)
        model["limit"] = {"context": conn.context_window, "output": output}
    return model


TOOLS = {"claude": _claude, "codex": _codex, "opencode": _opencode}


def launch_plan(tool: str, conn: Connection) -> LaunchPlan:
    try:
        return TOOLS[tool](conn)
    except KeyError:
        raise ValueError(f"unknown tool '{tool}'; choose one of {', '.join(TOOLS)}") from None


def client_host(host: str) -> str:
    """The address a local client dials for a server bound to ``host``."""
    if host in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
