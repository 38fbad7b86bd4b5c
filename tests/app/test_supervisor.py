"""The shell's controller and supervisor with a real `omlx serve` child, no GUI."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import psutil

from app.menu import find, visible
from app.ports import free_port
from app.stats import from_health
from app.status import ServerState
from app.supervisor import SupervisorPolicy, backoff_delay
from tests.app.conftest import FAST, wait_for
from tests.fixtures.servers import serve_process


def _running(controller) -> bool:
    return controller.status.state is ServerState.RUNNING


def test_start_health_crash_restart_and_quit(make_controller):
    controller, recorder = make_controller()
    controller.dispatch("start").result()
    wait_for(lambda: _running(controller), what="the server to run")
    status = controller.status
    assert status.port == controller.config.port and not status.adopted
    assert httpx.get(controller.base_url + "/health").json()["status"] == "ok"
    assert find(controller.menu(), f"Running on :{status.port}").enabled is False
    assert find(controller.menu(), "Stop Server").enabled
    assert not find(controller.menu(), "Start Server").enabled

    # The Stats submenu shows the server's numbers (/admin/api/stats, else /health).
    wait_for(lambda: _stat_lines(controller)[0].startswith("Requests: 0 running"), 10, "stats")
    assert any(line.startswith("Memory: ") and " of " in line for line in _stat_lines(controller))
    health = from_health(httpx.get(controller.base_url + "/health").json())
    assert health.requests_in_flight == 0 and health.memory_limit_bytes > 0
    logs = controller.config.base_path / "logs"
    wait_for(lambda: "listening on" in (logs / "server.log").read_text(), what="server.log")
    # Every log record is in server.log once; the console log keeps only what logging
    # misses (start-up failures, tracebacks), so it does not repeat them.
    console = logs / "server-console.log"
    assert not console.exists() or "listening on" not in console.read_text()

    first_pid = status.pid
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: controller.status.num_restarts == 1, timeout_s=10, what="the crash")
    crashed_at = time.monotonic()
    assert controller.status.state is ServerState.STARTING
    assert "exited with code -9" in controller.status.message
    wait_for(lambda: _running(controller), what="the restart")
    assert time.monotonic() - crashed_at >= FAST.backoff_base_s * 0.8  # waited its backoff
    restarted = controller.status
    assert restarted.pid != first_pid and restarted.port == status.port
    assert "Restarted 1× after a crash" in [e.title for e in visible(controller.menu())]
    assert httpx.get(controller.base_url + "/health").status_code == 200

    started = time.monotonic()
    controller.dispatch("quit").result()
    assert time.monotonic() - started < FAST.stop_timeout_s
    assert controller.status.state is ServerState.STOPPED
    assert controller.status.exit_code == 0  # SIGINT: a graceful uvicorn shutdown
    assert not psutil.pid_exists(restarted.pid)
    assert ServerState.STARTING in recorder.states() and ServerState.RUNNING in recorder.states()


def test_hang_is_reported_and_stop_is_bounded(make_controller):
    # /health's timeout and the stop's wait are what a hang costs: each poll and the
    # stop wait their full length here, so both are short.
    policy = SupervisorPolicy(**{**_fields(FAST), "health_timeout_s": 0.5, "stop_timeout_s": 0.5})
    controller, _ = make_controller(policy=policy)
    controller.dispatch("start").result()
    wait_for(lambda: _running(controller), what="the server to run")
    pid = controller.status.pid

    os.kill(pid, signal.SIGSTOP)  # alive but silent: a hung server
    try:
        wait_for(
            lambda: controller.status.state is ServerState.NOT_RESPONDING, 15, "not responding"
        )
        assert "/health did not answer" in controller.status.reason
        assert controller.menu()[0].title == f"Not responding on :{controller.status.port}"
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: _running(controller), 15, "recovery")

        os.kill(pid, signal.SIGSTOP)  # a stopped process ignores SIGINT: stop must kill it
        started = time.monotonic()
        controller.dispatch("stop").result()
        assert time.monotonic() - started < policy.stop_timeout_s + 3
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)
    assert controller.status.state is ServerState.STOPPED
    assert "killed" in controller.status.message
    assert controller.status.exit_code == -signal.SIGKILL
    wait_for(lambda: not psutil.pid_exists(pid), 5, "the hung server to be gone")


def test_crash_loop_ends_in_error_with_the_reason(make_controller):
    # Backoff 0.1, 0.2, 0.4 s: the loop, not the waits, is what is under test (FAST's
    # 0.5 s base is checked by test_start_health_crash_restart_and_quit).
    policy = SupervisorPolicy(**{**_fields(FAST), "backoff_base_s": 0.1})
    controller, _ = make_controller(policy=policy, extra=("--max-process-memory", "bogus"))
    controller.dispatch("start").result()
    wait_for(lambda: controller.status.state is ServerState.ERROR, 60, "the error state")
    status = controller.status
    assert status.num_restarts == FAST.max_crashes
    assert "4 times in a row" in status.reason
    assert "max_process_memory" in status.reason  # the server's own message, from its log
    assert controller.menu()[0].title.startswith("Error: server exited with code 2")
    assert find(controller.menu(), "Start Server").enabled  # the user can try again


def test_port_held_by_another_omlx_is_offered(make_controller, tmp_path, tiny_models_dir):
    with serve_process(tmp_path / "other", tiny_models_dir) as (_proc, url):
        port = int(url.rsplit(":", 1)[1])
        controller, _ = make_controller(port=port)
        controller.dispatch("start").result()
        offer = controller.status.offer
        assert offer is not None and offer.port == port
        assert controller.status.state is ServerState.STOPPED
        assert controller.menu()[0].title.startswith("omlx ") and f":{port}" in offer_title(
            controller
        )

        controller.dispatch("use_running").result()
        wait_for(lambda: _running(controller), 10, "adoption")
        assert controller.status.adopted and controller.status.pid is None
        assert controller.status.port == port
        assert find(controller.menu(), "Disconnect").enabled

        controller.dispatch("stop").result()  # detaches; never stops someone else's server
        assert httpx.get(url + "/health").status_code == 200

        controller.dispatch("start").result()  # offered again; this time run our own
        controller.dispatch("start_other_port").result()
        wait_for(lambda: _running(controller), what="our own server")
        ours = controller.status
        assert ours.port != port and not ours.adopted and ours.pid is not None
        assert f"this one runs on :{ours.port}" in ours.message
        assert httpx.get(f"http://127.0.0.1:{ours.port}/health").status_code == 200


def test_port_held_by_another_program_moves_to_a_free_port(make_controller):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        controller, _ = make_controller(port=port)
        controller.dispatch("start").result()
        wait_for(lambda: _running(controller), what="the server on another port")
        status = controller.status
        assert status.port != port
        assert status.message == f"Port {port} is used by another program; using {status.port}"
        assert httpx.get(controller.base_url + "/health").status_code == 200


def test_backoff_doubles_and_is_capped():
    policy = SupervisorPolicy(backoff_base_s=1.0, backoff_max_s=30.0)
    assert [backoff_delay(policy, n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_launch_at_login_toggle_writes_the_autostart_entry(make_controller, tmp_path):
    controller, _ = make_controller(port=free_port())
    entry = tmp_path / "home" / ".config" / "autostart" / "omlx.desktop"
    assert find(controller.menu(), "Launch at Login").checked is False
    controller.dispatch("toggle_login").result()
    assert "Exec=omlx-app" in entry.read_text()
    assert find(controller.menu(), "Launch at Login").checked is True
    controller.dispatch("toggle_login").result()
    assert not entry.exists()


def _stat_lines(controller) -> list[str]:
    return [entry.title for entry in visible(find(controller.menu(), "Stats").children)]


def offer_title(controller) -> str:
    return next(e.title for e in controller.menu() if e.action == "use_running")


def _fields(policy: SupervisorPolicy) -> dict:
    return {name: getattr(policy, name) for name in policy.__slots__}
