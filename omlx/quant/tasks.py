"""oQ tasks for the server: one at a time, each in a child process.

The child (``python -m omlx.quant.worker``) reports progress as JSON lines; a
runner thread follows it and keeps the task's phase, percent and result. While
a child runs, its memory is added to the server's readings (``track_process``)
so the memory enforcer sees it. Cancel terminates the child and removes its
partial folder. No mlx import here: the server's event loop stays free.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from omlx.errors import NotFoundError, OutputExistsError, TaskConflictError
from omlx.models.remote_code import require_allowed
from omlx.quant.estimate import source_config
from omlx.quant.levels import check_group_size, get_level
from omlx.quant.names import (
    check_free,
    check_output_name,
    default_output_name,
    temp_dir_for,
)

log = logging.getLogger(__name__)

RUNNING_PHASES = ("loading", "measuring", "quantizing", "evaluating", "saving")
FINISHED_PHASES = ("done", "failed", "cancelled")
RESULT_FIELDS = (
    "size_bytes",
    "bits_per_weight",
    "perplexity_before",
    "perplexity_after",
    "num_layers",
    "bits_histogram",
)
# ETA needs a little progress to extrapolate from.
MIN_FRACTION_FOR_ETA = 0.02
STDERR_TAIL_CHARS = 2000


class ProcessTracker(Protocol):
    def track_process(self, pid: int) -> None: ...
    def untrack_process(self, pid: int) -> None: ...


@dataclass(slots=True)
class QuantTask:
    id: str
    model: str
    source_path: Path
    level: str
    group_size: int
    output_path: Path
    trust_remote_code: bool = False  # the model's setting
    created_at: float = field(default_factory=time.time)
    phase: str = "queued"
    fraction: float = 0.0
    error: str | None = None
    result: dict[str, Any] | None = None
    started_s: float | None = None  # monotonic
    finished_s: float | None = None
    cancel_requested: bool = False

    @property
    def active(self) -> bool:
        return self.phase not in FINISHED_PHASES

    def cancel(self) -> bool:
        """A queued task ends now; a running one is asked to stop (the runner ends
        it). True when it is running: its process must be stopped."""
        if self.phase == "queued":
            self.phase, self.finished_s = "cancelled", time.monotonic()
            return False
        if self.active:
            self.cancel_requested = True
        return self.active

    def to_dict(self, now_s: float) -> dict[str, Any]:
        elapsed = 0.0
        if self.started_s is not None:
            elapsed = (self.finished_s or now_s) - self.started_s
        eta = None
        if self.phase == "done":
            eta = 0.0
        elif self.phase in RUNNING_PHASES and self.fraction >= MIN_FRACTION_FOR_ETA:
            eta = round(elapsed * (1 - self.fraction) / self.fraction, 1)
        return {
            "id": self.id,
            "model": self.model,
            "level": self.level,
            "group_size": self.group_size,
            "output_name": self.output_path.name,
            "output_path": str(self.output_path),
            "phase": self.phase,
            "percent": round(100 * self.fraction, 1),
            "elapsed_s": round(elapsed, 1),
            "eta_s": eta,
            "error": self.error,
            "created_at": round(self.created_at, 3),
            "result": self.result,
        }


class TaskManager:
    """Queue and run oQ tasks writing into ``output_dir`` (the first model dir)."""

    def __init__(
        self,
        output_dir: Path,
        tracker: ProcessTracker | None = None,
        worker_args: Sequence[str] = (),
        python: str = sys.executable,
    ):
        self.output_dir = Path(output_dir)
        self._tracker = tracker
        self._worker_args = list(worker_args)
        self._python = python
        self._tasks: dict[str, QuantTask] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- API ------------------------------------------------------------------

    def submit(
        self,
        model: str,
        source: Path,
        level: str,
        group_size: int,
        output_name: str | None,
        *,
        trust_remote_code: bool = False,
    ) -> dict[str, Any]:
        """Queue a task; 400 for a bad level / group size / name, 409 for a taken name,
        403 for a folder shipping code ``trust_remote_code`` (the model's setting) does
        not allow."""
        level = get_level(level).name
        check_group_size(group_size)
        source_config(source)
        require_allowed(model, source, trust_remote_code)
        name = check_output_name(output_name or default_output_name(model, level))
        dest = check_free(self.output_dir / name)
        with self._lock:
            if any(t.active and t.output_path == dest for t in self._tasks.values()):
                raise OutputExistsError(
                    f"a queued or running task already writes '{name}'", param="output_name"
                )
            task = QuantTask(
                uuid.uuid4().hex[:12], model, source, level, group_size, dest, trust_remote_code
            )
            self._tasks[task.id] = task
            self._ensure_runner()
            self._changed.notify_all()
            return task.to_dict(time.monotonic())

    def list(self) -> list[dict[str, Any]]:
        """Every task, newest first."""
        with self._lock:
            now = time.monotonic()
            return [t.to_dict(now) for t in reversed(self._tasks.values())]

    def get(self, task_id: str) -> dict[str, Any]:
        with self._lock:
            return self._task(task_id).to_dict(time.monotonic())

    def cancel(self, task_id: str, wait_s: float = 10.0) -> dict[str, Any]:
        """Stop a queued or running task; waits up to ``wait_s`` until its partial
        output is gone. Cancelling a finished task changes nothing."""
        with self._lock:
            task = self._task(task_id)
            if task.cancel() and self._proc is not None:
                self._proc.terminate()
            self._changed.wait_for(lambda: not task.active, timeout=wait_s)
            return task.to_dict(time.monotonic())

    def delete(self, task_id: str) -> None:
        """Forget a finished task (its model folder stays); 409 while it is queued or running."""
        with self._lock:
            task = self._task(task_id)
            if task.active:
                raise TaskConflictError(
                    f"task {task_id} is {task.phase}; cancel it before deleting it"
                )
            del self._tasks[task_id]

    def shutdown(self, timeout_s: float = 15.0) -> None:
        """Cancel everything and stop the runner (the app's lifespan end)."""
        with self._lock:
            self._closed = True
            for task in self._tasks.values():
                task.cancel()
            if self._proc is not None:
                self._proc.terminate()
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _task(self, task_id: str) -> QuantTask:
        task = self._tasks.get(task_id)
        if task is None:
            raise NotFoundError(f"no quantization task with id '{task_id}'", param="id")
        return task

    # -- runner ---------------------------------------------------------------

    def _ensure_runner(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="oq-tasks", daemon=True)
            self._thread.start()

    def _next(self) -> QuantTask | None:
        """The oldest queued task (lock held), waiting for one; None once closed."""
        while not self._closed:
            queued = next((t for t in self._tasks.values() if t.phase == "queued"), None)
            if queued is not None:
                return queued
            self._changed.wait()
        return None

    def _run(self) -> None:
        while True:
            with self._lock:
                task = self._next()
            if task is None:
                return
            with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as stderr:
                with self._lock:
                    if task.phase != "queued" or self._closed:  # cancelled meanwhile
                        continue
                    try:
                        proc = self._start(task, stderr)
                    except OSError as exc:
                        self._end(task, "failed", f"cannot start the quantization worker: {exc}")
                        continue
                self._follow(task, proc, stderr)

    def _start(self, task: QuantTask, stderr: IO[str]) -> subprocess.Popen[str]:
        cmd = [
            self._python,
            "-m",
            "omlx.quant.worker",
            str(task.source_path),
            str(task.output_path),
            "--level",
            task.level,
            "--group-size",
            str(task.group_size),
            *(["--trust-remote-code"] if task.trust_remote_code else []),
            *self._worker_args,
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
        self._proc = proc
        task.phase, task.started_s = "loading", time.monotonic()
        if self._tracker is not None:
            self._tracker.track_process(proc.pid)
        log.info("oQ task %s: %s -> %s (%s)", task.id, task.model, task.output_path, task.level)
        return proc

    def _follow(self, task: QuantTask, proc: subprocess.Popen[str], stderr: IO[str]) -> None:
        error = None
        assert proc.stdout is not None
        for line in proc.stdout:
            event = _parse_event(line)
            with self._lock:
                if event.get("event") == "progress" and not task.cancel_requested:
                    task.phase = str(event.get("phase", task.phase))
                    task.fraction = float(event.get("fraction", task.fraction))
                elif event.get("event") == "done":
                    task.result = {k: event["result"].get(k) for k in RESULT_FIELDS}
                elif event.get("event") == "error":
                    error = str(event.get("message"))
        returncode = _wait(proc)
        if self._tracker is not None:
            self._tracker.untrack_process(proc.pid)
        with self._lock:
            self._proc = None
            if task.result is not None and returncode == 0:
                self._end(task, "done", None)
            elif task.cancel_requested:
                self._end(task, "cancelled", None)
            else:
                self._end(task, "failed", error or _crash_message(returncode, stderr))

    def _end(self, task: QuantTask, phase: str, error: str | None) -> None:
        """Finish ``task`` (lock held); anything but done leaves no partial folder."""
        if phase != "done":
            shutil.rmtree(temp_dir_for(task.output_path), ignore_errors=True)
        else:
            task.fraction = 1.0
        task.phase, task.error, task.finished_s = phase, error, time.monotonic()
        log.info("oQ task %s %s%s", task.id, phase, f": {error}" if error else "")
        self._changed.notify_all()


def _parse_event(line: str) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return {}
    return event if isinstance(event, dict) else {}


def _wait(proc: subprocess.Popen[str], timeout_s: float = 10.0) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _crash_message(returncode: int, stderr: IO[str]) -> str:
    stderr.seek(0)
    tail = stderr.read()[-STDERR_TAIL_CHARS:].strip()
    reason = f"the quantization worker exited with code {returncode}"
    return f"{reason}: {tail}" if tail else reason
