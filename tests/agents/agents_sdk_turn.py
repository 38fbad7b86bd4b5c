"""One OpenAI Agents SDK run against an OpenAI-compatible server, set up as the SDK's
docs say for one (a client with the server's base URL, tracing off): an agent with
a ``shell`` function tool; prints the final output.

Run by tests/agents/test_agent_matrix.py with the SDK's own venv (.agents/py):
``python agents_sdk_turn.py BASE_URL KEY MODEL PROMPT``.
"""

from __future__ import annotations

import subprocess
import sys

from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI


@function_tool
def shell(command: str) -> str:
    """Run a shell command and return its output."""
    return subprocess.run(command, shell=True, capture_output=True, text=True).stdout


def main(base_url: str, key: str, model: str, prompt: str) -> None:
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key=key))
    set_tracing_disabled(True)
    agent = Agent(name="assistant", instructions="Be brief.", model=model, tools=[shell])
    print(Runner.run_sync(agent, prompt).final_output)


if __name__ == "__main__":
    main(*sys.argv[1:5])
