"""The server's life is bound to the shell's, and the shell's console logs stay bounded.

Real processes throughout: a shell process running the real Supervisor, a real
`omlx serve` child, SIGKILL, and children writing to real log files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from app.console_log import ConsoleLog, tail_line
from app.ports import free_port
from app.status import ServerState
from app.supervisor import SupervisorPolicy
from omlx.net import port_is_free
from tests.app.conftest import FAST, wait_for

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for the menu-bar shell: the real Supervisor starts a real server, then the
# process just lives (until the test kills it).
SHELL = """
import sys, time
from pathlib import Path
from app.supervisor import ServeConfig, Supervisor
from app.status import ServerState
from tests.app.conftest import FAST

base, models, port = sys.argv[1:4]
config = ServeConfig(Path(base), extra_args=("--model-dir", models, "--no-install-default"))
supervisor = Supervisor(config, FAST)
supervisor.start(int(port))
deadline = time.monotonic() + 90
while supervisor.poll().state is not ServerState.RUNNING and time.monotonic() < deadline:
    time.sleep(0.2)
print(supervisor.status.pid, flush=True)
time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_server_stops_when_its_shell_is_killed(tmp_path, tiny_models_dir):
    base, port = tmp_path / "base", free_port()
    shell = subprocess.Popen(
        [sys.executable, "-c", SHELL, str(base), str(tiny_models_dir), str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    server_pid = None
    try:
        server_pid = int(shell.stdout.readline())
        assert _alive(server_pid) and not port_is_free("127.0.0.1", port)
        assert psutil.Process(server_pid).ppid() == shell.pid

        os.kill(shell.pid, signal.SIGKILL)  # a force-quit or crash: no chance to clean up
        shell.wait()
        killed_at = time.monotonic()
        wait_for(lambda: not _alive(server_pid), 20, "the orphaned server to exit")
        wait_for(lambda: port_is_free("127.0.0.1", port), 5, "its port to be free")
        assert time.monotonic() - killed_at < 20
    finally:
        if shell.poll() is None:
            shell.kill()
        if server_pid is not None and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
    server_log = (base / "logs" / "server.log").read_text()
    assert "the app that started this server went away: shutting down" in server_log
    # The graceful path (uvicorn's and the app's shutdown ran), not the last resort.
    assert "Application shutdown complete" in server_log and "did not stop" not in server_log


def _answered_after(controller, timeout_s: float | None = None) -> tuple[threading.Event, dict]:
    answered, seen = threading.Event(), {}
    pid, port = controller.status.pid, controller.status.port

    def done() -> None:  # what the macOS delegate does here: reply "terminate now"
        seen.update(server_alive=_alive(pid), port_free=port_is_free("127.0.0.1", port))
        answered.set()

    controller.shutdown_then(done, timeout_s)
    return answered, seen


def test_quitting_the_shell_stops_the_server_before_the_app_may_exit(make_controller):
    controller, _ = make_controller()
    controller.dispatch("start").result()
    wait_for(lambda: controller.status.state is ServerState.RUNNING, what="the server")
    pid = controller.status.pid

    answered, seen = _answered_after(controller)
    assert answered.wait(FAST.stop_timeout_s + 15), "the quit was never answered"
    assert seen == {"server_alive": False, "port_free": True}
    assert controller.status.state is ServerState.STOPPED and not _alive(pid)


def test_quit_is_answered_within_its_bound_even_if_the_server_hangs(make_controller):
    fields = {name: getattr(FAST, name) for name in FAST.__slots__}
    controller, _ = make_controller(policy=SupervisorPolicy(**{**fields, "stop_timeout_s": 4.0}))
    controller.dispatch("start").result()
    wait_for(lambda: controller.status.state is ServerState.RUNNING, what="the server")
    pid = controller.status.pid
    os.kill(pid, signal.SIGSTOP)  # ignores SIGINT until the stop's deadline kills it
    try:
        started = time.monotonic()
        answered, seen = _answered_after(controller, timeout_s=1.0)
        assert answered.wait(5)
        assert time.monotonic() - started < 3
        assert seen["server_alive"]  # answered anyway: the app must not hang on quit
        wait_for(lambda: not _alive(pid), 15, "the hung server to be killed")
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)


def test_bad_parent_fd_is_a_clear_error(tmp_path):
    def serve(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "omlx.cli", "--base-path", str(tmp_path), "serve"]
        return subprocess.run(
            [*cmd, "--port", str(free_port()), *flags],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )

    closed = serve("--parent-fd", "97")
    assert closed.returncode == 2
    assert "omlx: --parent-fd 97 is not an open file descriptor" in closed.stderr
    not_a_pipe = serve("--parent-fd", "0")  # /dev/null: EOF at once, never a parent's pipe
    assert not_a_pipe.returncode == 2
    assert "--parent-fd 0 is not a pipe" in not_a_pipe.stderr


CHATTY_CHILD = r"""
import sys
for i in range(3000):
    print(f"line {i:04d} " + "x" * 40, file=sys.stderr)
sys.stderr.write("loading 10%\rloading 55%\rloading 100%\n")
raise SystemExit("boom: the line that explains the crash")
"""


def test_console_log_is_rotated_and_keeps_the_last_lines(tmp_path):
    path = tmp_path / "logs" / "window.log"
    console = ConsoleLog(path, max_bytes=20_000, backups=2)
    child = subprocess.Popen([sys.executable, "-c", CHATTY_CHILD], stderr=subprocess.PIPE)
    console.copy_from(child.stderr, "chatty")
    assert child.wait(60) == 1
    console.wait()
    console.close()

    # ~150 kB written: three files of at most 20 kB remain, the oldest lines dropped.
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "window.log",
        "window.log.1",
        "window.log.2",
    ]
    assert all(p.stat().st_size <= 20_000 for p in path.parent.iterdir())
    assert "line 0000 " not in (path.parent / "window.log.2").read_text()
    assert tail_line(path) == "boom: the line that explains the crash"
    text = path.read_text()
    assert "line 2999 " in text
    assert "loading 100%\n" in text and "loading 55%" not in text  # as a terminal shows it
