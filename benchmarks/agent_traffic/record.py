"""Record what a real coding agent sends: a logging server with a scripted model side.

The server speaks the three wire formats the agents use (Anthropic ``/v1/messages``,
OpenAI Responses ``/v1/responses``, OpenAI ``/v1/chat/completions``), always streaming
when asked, and logs every request exactly (method, path, headers less credentials,
JSON body). Its "model" answers from a script: while the conversation holds fewer tool
results than ``--tool-calls``, it calls the agent's shell tool (``ls``, then ``cat``
of a file); then it answers in text. A request without tools (titles, summaries) gets
a short text. The answer depends only on the request, so a re-run records the same
session.

    python benchmarks/agent_traffic/record.py --tool claude --out claude.json

starts the server, runs the real CLI (installed under ``--npm-prefix``) against it the
way ``omlx launch <tool>`` points it, in a scratch HOME with telemetry off, and writes the
request sequence to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.agent_traffic.scripted import answer_for
from benchmarks.agent_traffic.wire import stream_answer
from omlx.launch import Connection, launch_plan

PACKAGES = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
}
SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "api-key"}
MODEL = "agent-model"
# The user's message, per session. Session 2 is the same tool, version and settings
# started again in the same project with a new question: what a user's next session of
# the day sends (the same system prompt and tools, a different first user message).
PROMPTS = {
    1: (
        "List the files in this directory, then show me what notes.txt says, "
        "and tell me in one sentence what the project is."
    ),
    2: "How many lines does main.py have, and what does it print? Check, then answer briefly.",
}
PROMPT = PROMPTS[1]


class Log:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.requests.append(entry)


def make_handler(log: Log, tool_calls: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _record(self, body: Any) -> None:
            headers = {
                k.lower(): v for k, v in self.headers.items() if k.lower() not in SECRET_HEADERS
            }
            log.add(
                {
                    "t": time.time(),
                    "method": self.command,
                    "path": self.path,
                    "headers": headers,
                    "body": body,
                }
            )

        def _send_json(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._record(None)
            if self.path.rstrip("/").endswith("/models"):
                model = {"id": MODEL, "object": "model", "type": "model", "display_name": MODEL}
                self._send_json(200, {"object": "list", "data": [model], "has_more": False})
            else:
                self._send_json(404, {"error": {"message": f"no route {self.path}"}})

        def do_HEAD(self) -> None:
            self._record(None)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = {"_raw": raw.decode("utf-8", "replace")}
            self._record(body)
            path = self.path.split("?")[0]
            kind = {
                "/v1/messages": "anthropic",
                "/v1/responses": "responses",
                "/v1/chat/completions": "chat",
            }.get(path)
            if kind is None or not isinstance(body, dict):
                self._send_json(404, {"error": {"message": f"no route {self.path}"}})
                return
            if path.endswith("/count_tokens"):
                self._send_json(200, {"input_tokens": len(raw) // 4})
                return
            answer = answer_for(kind, body, tool_calls)
            stream_answer(self, kind, body, answer)

    return Handler


def agent_command(
    tool: str, npm_prefix: Path, base_url: str, work: Path, prompt: str = PROMPT
) -> tuple[list[str], dict]:
    """The CLI invocation ``omlx launch`` would make, in non-interactive mode."""
    plan = launch_plan(tool, Connection(base_url, None, MODEL))
    program = str(npm_prefix / "node_modules" / ".bin" / plan.program)
    extra = {
        "claude": ["-p", prompt, "--dangerously-skip-permissions", "--output-format", "text"],
        "codex": [
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            prompt,
        ],
        "opencode": ["run", prompt],
    }[tool]
    home = work / "home"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "OPENAI"))},
        **plan.env,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "CODEX_HOME": str(home / ".codex"),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "NO_COLOR": "1",
        # Claude Code refuses to skip permissions as root unless told it is sandboxed.
        "IS_SANDBOX": "1",
    }
    return [program, *plan.args, *extra], env


def make_project(work: Path) -> Path:
    project = work / "project"
    project.mkdir(parents=True)
    (project / "notes.txt").write_text("omlx: a local LLM server for Apple Silicon.\n")
    (project / "main.py").write_text('print("hello")\n')
    (work / "home" / ".codex").mkdir(parents=True)
    return project


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", required=True, choices=["claude", "codex", "opencode"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--npm-prefix", type=Path, default=Path("/tmp/agents-npm"))
    parser.add_argument("--tool-calls", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument(
        "--session", type=int, choices=sorted(PROMPTS), default=1, help="which user prompt"
    )
    args = parser.parse_args(argv)

    log = Log()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(log, args.tool_calls))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}"
    work = Path(tempfile.mkdtemp(prefix="agent-rec-"))
    try:
        project = make_project(work)
        prompt = PROMPTS[args.session]
        command, env = agent_command(args.tool, args.npm_prefix, base_url, work, prompt)
        env["PWD"] = str(project)  # opencode takes its directory from PWD, not the cwd
        started = time.time()
        done = subprocess.run(
            command,
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            stdin=subprocess.DEVNULL,
        )
        print(f"{args.tool} exited {done.returncode} in {time.time() - started:.1f}s")
        print("stdout:", done.stdout[-2000:])
        print("stderr:", done.stderr[-3000:])
    finally:
        server.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True)
    session = {
        "tool": args.tool,
        "package": PACKAGES[args.tool],
        "version": version.stdout.split()[0] if version.stdout else "",
        "work_dir": str(work),
        "session": args.session,
        "prompt": prompt,
        "exit_code": done.returncode,
        "requests": log.requests,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(session, indent=1) + "\n")
    print(f"{len(log.requests)} requests -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
