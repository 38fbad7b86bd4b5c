"""Runs `omlx serve` as a child process: health polls, restart with backoff, bounded stop.

Passive by design: `poll()` does one step and the controller's monitor thread calls it,
so tests drive the same code with real processes and no hidden threads.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from app import paths
from app.console_log import ConsoleLog, tail_line
from app.ports import url_host
from app.status import ServerState, Status, readiness_from_health

log = logging.getLogger("omlx.app")

CONSOLE_LOG = "server-console.log"


@dataclass(frozen=True, slots=True)
class ServeConfig:
    base_path: Path
    host: str = "127.0.0.1"
    # Extra `omlx serve` flags (e.g. --model-dir); settings.json covers the rest.
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SupervisorPolicy:
    poll_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    # The first run may import the built-in model before it listens.
    start_timeout_s: float = 300.0
    max_failed_polls: int = 3
    hang_restart_s: float = 60.0
    stop_timeout_s: float = 10.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    max_crashes: int = 5
    # A run this long resets the crash streak: crashes far apart are not a loop.
    stable_s: float = 30.0


def backoff_delay(policy: SupervisorPolicy, num_crashes: int) -> float:
    """Delay before restart number ``num_crashes`` of a streak: 1, 2, 4, ... capped."""
    return min(policy.backoff_max_s, policy.backoff_base_s * 2 ** max(0, num_crashes - 1))


class Supervisor:
    def __init__(
        self,
        config: ServeConfig,
        policy: SupervisorPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.policy = policy or SupervisorPolicy()
        self.clock = clock
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._console: ConsoleLog | None = None
        # Write end of the pipe the server watches (--parent-fd): only this process holds
        # it, so the kernel closes it when we exit, crash or are force-quit.
        self._lifeline: int | None = None
        self._want_running = False
        self._status = Status()
        self._spawned_at = 0.0
        self._restart_at: float | None = None
        self._crash_streak = 0
        self._failed_polls = 0
        self._unhealthy_since: float | None = None

    @property
    def status(self) -> Status:
        return self._status

    @property
    def console_log(self) -> Path:
        return paths.log_dir(self.config.base_path) / CONSOLE_LOG

    @property
    def base_url(self) -> str | None:
        port = self._status.port
        return f"http://{url_host(self.config.host)}:{port}" if port else None

    def command(self, port: int, parent_fd: int | None = None) -> list[str]:
        # server.log has every log record; the console log keeps what logging misses.
        watch = ("--parent-fd", str(parent_fd), "--no-log-stderr") if parent_fd is not None else ()
        return paths.omlx_command(
            "--base-path",
            str(self.config.base_path),
            "serve",
            "--host",
            self.config.host,
            "--port",
            str(port),
            *watch,
            *self.config.extra_args,
        )

    def start(self, port: int, message: str = "") -> Status:
        """Run our own server on ``port``; the next polls report its progress."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._status
            self._want_running = True
            self._crash_streak = 0
            self._status = Status(ServerState.STARTING, port=port, message=message)
            self._spawn(port)
            return self._status

    def adopt(self, port: int, message: str = "") -> Status:
        """Watch another omlx on ``port`` without owning it."""
        with self._lock:
            self._want_running = False
            self._status = Status(ServerState.STARTING, port=port, adopted=True, message=message)
        return self.poll()

    def stop(self) -> Status:
        """Stop our server gracefully (SIGINT, as Ctrl-C), killing it after stop_timeout_s."""
        with self._lock:
            self._want_running = False
            self._restart_at = None
            message = ""
            proc = self._proc
            exit_code = proc.returncode if proc is not None else self._status.exit_code
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT if sys.platform != "win32" else signal.SIGTERM)
                try:
                    proc.wait(self.policy.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    message = f"Server did not stop in {self.policy.stop_timeout_s:g} s; killed"
                    log.warning("%s", message)
                exit_code = proc.returncode
            self._close_proc()
            if self._console is not None:
                self._console.wait()
            self._status = Status(ServerState.STOPPED, message=message, exit_code=exit_code)
            return self._status

    def poll(self) -> Status:
        """One supervision step: spawn when due, reap a crash, or check /health."""
        with self._lock:
            now = self.clock()
            if self._status.adopted:
                self._poll_adopted()
            elif self._proc is None:
                if self._want_running and self._restart_at is not None and now >= self._restart_at:
                    self._restart_at = None
                    self._spawn(self._status.port or 0)
            elif self._proc.poll() is not None:
                self._on_exit(now)
            else:
                self._poll_child(now)
            return self._status

    def _spawn(self, port: int) -> None:
        if self._console is None:
            self._console = ConsoleLog(self.console_log)
        watch_fd, self._lifeline = os.pipe()  # both ends close-on-exec: no other child has them
        cmd = self.command(port, parent_fd=watch_fd)
        log.info("starting: %s", " ".join(cmd))
        try:
            self._proc = subprocess.Popen(
                cmd,
                cwd=paths.child_cwd(),
                env=paths.server_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(watch_fd,),
                # A terminal's Ctrl-C goes to the shell, which then stops the server in
                # order; if the shell dies instead, the server sees --parent-fd close.
                # (Not PR_SET_PDEATHSIG: Linux only, and it fires when the spawning
                # *thread* ends.)
                start_new_session=True,
            )
        except OSError:
            self._close_lifeline()
            raise
        finally:
            os.close(watch_fd)
        assert self._proc.stdout is not None
        self._console.copy_from(self._proc.stdout, "server")
        self._spawned_at = self.clock()
        self._failed_polls = 0
        self._unhealthy_since = None
        self._status = replace(self._status, state=ServerState.STARTING, pid=self._proc.pid)

    def _healthy(self) -> bool:
        url = self.base_url
        if url is None:
            return False
        try:
            resp = httpx.get(url + "/health", timeout=self.policy.health_timeout_s)
            if resp.status_code == 200:  # which models are still loading at start
                self._status = replace(self._status, models=readiness_from_health(resp.json()))
            return resp.status_code == 200
        except (httpx.HTTPError, ValueError):
            return False

    def _poll_adopted(self) -> None:
        if self._healthy():
            self._status = replace(self._status, state=ServerState.RUNNING)
        else:
            self._status = Status(
                ServerState.STOPPED, message=f"The omlx on :{self._status.port} went away"
            )

    def _poll_child(self, now: float) -> None:
        if self._healthy():
            self._failed_polls = 0
            self._unhealthy_since = None
            self._status = replace(self._status, state=ServerState.RUNNING, reason="")
            return
        state = self._status.state
        if state is ServerState.STARTING:
            if now - self._spawned_at > self.policy.start_timeout_s:
                waited = self.policy.start_timeout_s
                self._mark_unhealthy(now, f"no answer on /health {waited:g} s after start")
            return
        self._failed_polls += 1
        if state is ServerState.RUNNING and self._failed_polls >= self.policy.max_failed_polls:
            self._mark_unhealthy(now, f"/health did not answer {self._failed_polls} times")
        elif state is ServerState.NOT_RESPONDING and self._hung_too_long(now):
            log.warning("server hung for %.0f s: killing it", self.policy.hang_restart_s)
            assert self._proc is not None
            self._proc.kill()
            self._proc.wait()
            self._on_exit(now, hung=True)

    def _hung_too_long(self, now: float) -> bool:
        since = self._unhealthy_since
        return since is not None and now - since > self.policy.hang_restart_s

    def _mark_unhealthy(self, now: float, reason: str) -> None:
        self._unhealthy_since = now
        self._status = replace(self._status, state=ServerState.NOT_RESPONDING, reason=reason)
        log.warning("server not responding: %s", reason)

    def _on_exit(self, now: float, hung: bool = False) -> None:
        assert self._proc is not None
        code = self._proc.returncode
        quick = now - self._spawned_at < self.policy.stable_s
        self._crash_streak = self._crash_streak + 1 if quick else 1
        self._close_proc()
        what = "hung" if hung else f"exited with code {code}"
        assert self._console is not None
        self._console.wait()  # its last lines explain the exit
        tail = tail_line(self.console_log)
        log.warning("server %s (streak %d): %s", what, self._crash_streak, tail)
        if not self._want_running:
            self._status = Status(ServerState.STOPPED, message=f"Server {what}", exit_code=code)
            return
        if self._crash_streak > self.policy.max_crashes:
            self._want_running = False
            reason = f"server {what} {self._crash_streak} times in a row: {tail}"
            self._status = replace(
                self._status, state=ServerState.ERROR, pid=None, reason=reason, exit_code=code
            )
            return
        delay = backoff_delay(self.policy, self._crash_streak)
        self._restart_at = now + delay
        num = self._status.num_restarts + 1
        self._status = replace(
            self._status,
            state=ServerState.STARTING,
            pid=None,
            exit_code=code,
            num_restarts=num,
            message=f"Server {what}; restarting in {delay:g} s (restart {num})",
        )

    def _close_proc(self) -> None:
        self._proc = None
        self._close_lifeline()

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
