"""The compatibility matrix: the real coding agents, at the versions setup.sh pins,
each completes a non-interactive turn against a live omlx and exits 0 with the
model's text in its output. Claude Code, Codex and opencode start through
``omlx launch TOOL -- ARGS``, exactly as a user starts them; Qwen Code, aider, ``llm``
and an OpenAI Agents SDK script are configured as their docs say for an
OpenAI-compatible server.

The model is tests/fixtures/agent_models.py's scripted one (a 128k context holds
the agents' real prompts: Claude Code ~12k tokens, Qwen Code ~14k, opencode ~7.7k,
Codex ~6.5k). A prompt that says ``omlx-call:NAME`` makes it call tool NAME with
``echo omlx-$((6*7))``; its final answer (AFTER_TOOL_TEXT) comes only when the
request after the call carries the command's real output, ``omlx-42``, which is not
in the command: so that answer in the agent's output proves the round trip (the
agent parsed the call, ran it, and sent the result back to the server).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.agents.conftest import KEY, MODEL, NPM_BIN, AgentRun, agent_program
from tests.fixtures.agent_models import AFTER_TOOL_TEXT, PONG_TEXT, ask_for_call
from tests.fixtures.prom import scrape, value

pytestmark = [pytest.mark.spawns, pytest.mark.agents]

SDK_SCRIPT = Path(__file__).with_name("agents_sdk_turn.py")


def output_of(out: subprocess.CompletedProcess) -> str:
    """The agent's output; a failed run fails the test with what the agent said."""
    said = f"exit {out.returncode}\nstdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    assert out.returncode == 0, said
    return out.stdout


# --- Claude Code: the Anthropic Messages API -------------------------------------------


def test_claude_code_one_turn(agent: AgentRun) -> None:
    agent_program("npm", "node_modules", ".bin", "claude")
    out = agent.launch("claude", "-p", "say hi")
    assert PONG_TEXT in output_of(out)


def test_claude_code_tool_round_trip(agent: AgentRun) -> None:
    agent_program("npm", "node_modules", ".bin", "claude")
    # -p mode cannot ask before running a tool: allow Bash up front (this version runs
    # a plain `echo` without asking, a stricter one would refuse it otherwise).
    out = agent.launch("claude", "-p", ask_for_call("Bash"), "--allowedTools", "Bash")
    assert AFTER_TOOL_TEXT in output_of(out)


def test_a_new_claude_code_session_reuses_the_last_ones_prompt(agent: AgentRun) -> None:
    """A user restarts Claude Code with a new question: as ``omlx launch`` starts it,
    the new session's requests reuse the last session's system prompt and tools from
    the prefix cache. (Claude Code's own attribution line, whose hash changes with each
    session's first message, would open the prompt with new text: 25 of ~12k tokens
    shared, measured with benchmarks/agent_traffic's recordings.)"""
    agent_program("npm", "node_modules", ".bin", "claude")
    headers = {"Authorization": f"Bearer {KEY}"}
    output_of(agent.launch("claude", "-p", "say hi"))
    before = scrape(agent.base_url, headers)
    assert PONG_TEXT in output_of(agent.launch("claude", "-p", "what is in this folder?"))
    after = scrape(agent.base_url, headers)

    def new(name: str) -> float:
        return value(after, name, model=MODEL) - value(before, name, model=MODEL)

    prompt, cached = new("omlx_prompt_tokens_total"), new("omlx_cached_prompt_tokens_total")
    assert prompt > 5000 and cached >= 0.9 * prompt, (prompt, cached)


# --- Codex: the Responses API -----------------------------------------------------------


def _quiet_codex(agent: AgentRun) -> None:
    # The user's own config.toml, as a privacy-minded user writes it.
    config = agent.home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("check_for_update_on_startup = false\n\n[analytics]\nenabled = false\n")


def test_codex_one_turn(agent: AgentRun) -> None:
    agent_program("npm", "node_modules", ".bin", "codex")
    _quiet_codex(agent)
    out = agent.launch("codex", "exec", "--skip-git-repo-check", "say hi")
    assert PONG_TEXT in output_of(out)


def test_codex_tool_round_trip(agent: AgentRun) -> None:
    agent_program("npm", "node_modules", ".bin", "codex")
    _quiet_codex(agent)
    # Codex's sandbox (bubblewrap) needs user namespaces a CI container may not have.
    args = ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    out = agent.launch("codex", *args, ask_for_call("exec_command"))
    assert AFTER_TOOL_TEXT in output_of(out)


# --- opencode: Chat Completions through @ai-sdk/openai-compatible -----------------------


def test_opencode_one_turn(agent: AgentRun) -> None:
    agent_program("npm", "node_modules", ".bin", "opencode")
    out = agent.launch("opencode", "run", "say hi")
    assert PONG_TEXT in output_of(out)


def test_opencode_tool_round_trip(agent: AgentRun) -> None:
    agent_program("npm", "node_modules", ".bin", "opencode")
    out = agent.launch("opencode", "run", ask_for_call("bash"))
    assert AFTER_TOOL_TEXT in output_of(out)


# --- Qwen Code: Chat Completions, configured by OPENAI_* --------------------------------


def _qwen(agent: AgentRun, *args: str) -> subprocess.CompletedProcess:
    settings = agent.home / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True)
    quiet = {"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}
    settings.write_text(json.dumps({**quiet, "general": {"disableAutoUpdate": True}}))
    env = {"OPENAI_BASE_URL": f"{agent.base_url}/v1", "OPENAI_API_KEY": KEY}
    return agent.run([NPM_BIN / "qwen", *args], OPENAI_MODEL=MODEL, **env)


def test_qwen_code_one_turn(agent: AgentRun) -> None:
    agent_program("npm", "node_modules", ".bin", "qwen")
    assert PONG_TEXT in output_of(_qwen(agent, "say hi"))


def test_qwen_code_tool_round_trip(agent: AgentRun) -> None:
    agent_program("npm", "node_modules", ".bin", "qwen")
    out = _qwen(agent, "--yolo", ask_for_call("run_shell_command"))
    assert AFTER_TOOL_TEXT in output_of(out)


# --- aider, llm and the OpenAI Agents SDK (PyPI) ----------------------------------------


def test_aider_one_turn(agent: AgentRun) -> None:
    aider = agent_program("aider", "bin", "aider")
    flags = ["--yes-always", "--no-git", "--no-check-update", "--no-analytics"]
    flags += ["--no-show-model-warnings", "--no-show-release-notes", "--no-pretty"]
    env = {"OPENAI_API_BASE": f"{agent.base_url}/v1", "OPENAI_API_KEY": KEY}
    out = agent.run([aider, "--model", f"openai/{MODEL}", *flags, "--message", "say hi"], **env)
    assert PONG_TEXT in output_of(out)


def test_llm_one_turn(agent: AgentRun) -> None:
    llm = agent_program("py", "bin", "llm")
    # llm's documented way to add an OpenAI-compatible model, its key in keys.json.
    user_dir = agent.home / "llm"
    user_dir.mkdir()
    entry = f'- model_id: omlx\n  model_name: {MODEL}\n  api_base: "{agent.base_url}/v1"\n'
    (user_dir / "extra-openai-models.yaml").write_text(entry + "  api_key_name: omlx\n")
    (user_dir / "keys.json").write_text(json.dumps({"omlx": KEY}))
    out = agent.run([llm, "-m", "omlx", "say hi"], LLM_USER_PATH=str(user_dir))
    assert PONG_TEXT in output_of(out)


def test_openai_agents_sdk_turn_with_a_tool(agent: AgentRun) -> None:
    python = agent_program("py", "bin", "python")
    out = agent.run([python, SDK_SCRIPT, f"{agent.base_url}/v1", KEY, MODEL, "say hi"])
    assert PONG_TEXT in output_of(out)
    out = agent.run([python, SDK_SCRIPT, f"{agent.base_url}/v1", KEY, MODEL, ask_for_call("shell")])
    assert AFTER_TOOL_TEXT in output_of(out)
