"""The server's Hub downloads: one or two at a time beside serving, kept across restarts.

Each task plans its download first (``omlx.models.downloads.plan_download``: every
refusal happens before a byte moves), then a runner thread follows its worker child,
sampling bytes and speed from the partial folder, and renames the finished folder into
the first model dir, where ``/v1/models`` finds it. Tasks live in
``<base>/downloads.json``: after a restart an unfinished task runs again from what its
partial folder holds, or shows as failed with the reason. A GGUF task downloads one
file and then imports it in a child process (phase "importing"; ``omlx.models.gguf_pull``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omlx.errors import NotFoundError, OmlxError, OutputExistsError, TaskConflictError
from omlx.models.downloads import (
    DownloadPlan,
    DownloadRun,
    disk_free_bytes,
    finish,
    inspect_summary,
    partial_dir_for,
    plan_download,
)
from omlx.models.gguf_pull import (
    check_import_disk,
    downloaded_gguf,
    drop_download,
    folder_fit,
    import_job,
    import_result,
    remove_import_leftovers,
    resolved_dtype,
)
from omlx.models.hub import HubAccess
from omlx.settings import Settings, read_settings_file, write_json_atomic

if TYPE_CHECKING:
    from omlx.engine.pool import EnginePool

log = logging.getLogger(__name__)

ACTIVE_PHASES = ("queued", "downloading", "finishing", "importing")
RUNNING_PHASES = ACTIVE_PHASES[1:]
MAX_PARALLEL = 2
POLL_S = 0.25
STATE_FILE = "downloads.json"
# -- the server's tasks ---------------------------------------------------------------


@dataclass(slots=True)
class DownloadTask:
    id: str
    repo_id: str
    revision: str
    commit: str
    name: str
    dest: Path
    bytes_total: int
    fit: dict[str, Any] | None
    created_at: float = field(default_factory=time.time)
    phase: str = "queued"
    bytes_done: int = 0
    speed_bps: float = 0.0
    error: str | None = None
    finished_at: float | None = None
    cancel_requested: bool = False
    gguf_file: str | None = None  # a GGUF import: the one file, then "importing"
    dtype: str | None = None
    result: dict[str, Any] | None = None  # a GGUF import's conversion summary
    baseline_bytes: int = 0  # the server's idle memory at submit, for the imported fit

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE_PHASES

    def plan(self) -> DownloadPlan:
        return DownloadPlan(
            self.repo_id,
            self.revision,
            self.commit,
            self.name,
            self.dest,
            self.bytes_total,
            None,
            self.gguf_file,
            self.dtype,
        )

    def to_dict(self) -> dict[str, Any]:
        eta = None
        if self.phase == "downloading" and self.speed_bps > 0:
            eta = round(max(0, self.bytes_total - self.bytes_done) / self.speed_bps, 1)
        elif self.phase == "done":
            eta = 0.0
        return {
            "id": self.id,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "name": self.name,
            "phase": self.phase,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "speed_bps": round(self.speed_bps, 1),
            "eta_s": eta,
            "error": self.error,
            "fit": self.fit,
            "created_at": round(self.created_at, 3),
            "finished_at": None if self.finished_at is None else round(self.finished_at, 3),
            "gguf_file": self.gguf_file,
            "dtype": self.dtype,
            "result": self.result,
        }

    def record(self) -> dict[str, Any]:
        """What downloads.json keeps (the API view plus where it writes)."""
        return {**self.to_dict(), "commit": self.commit, "dest": str(self.dest)}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> DownloadTask:
        return cls(
            id=str(data["id"]),
            repo_id=str(data["repo_id"]),
            revision=str(data["revision"]),
            commit=str(data["commit"]),
            name=str(data["name"]),
            dest=Path(data["dest"]),
            bytes_total=int(data["bytes_total"]),
            fit=data.get("fit"),
            created_at=float(data["created_at"]),
            phase=str(data["phase"]),
            bytes_done=int(data.get("bytes_done") or 0),
            error=data.get("error"),
            finished_at=data.get("finished_at"),
            gguf_file=data.get("gguf_file"),
            dtype=data.get("dtype"),
            result=data.get("result"),
        )


class DownloadManager:
    """Queue and run Hub downloads into the first model dir."""

    def __init__(
        self,
        settings: Settings,
        *,
        python: str = sys.executable,
        max_parallel: int = MAX_PARALLEL,
        disk_free: Callable[[Path], int] = disk_free_bytes,
        pool: EnginePool | None = None,
    ):
        self.settings = settings
        # The server's pool: an import child counts in its memory and is capped by it.
        self._pool = pool
        self._import_pids: dict[str, int] = {}
        # One import at a time, shared with the import route when there is a server:
        # each child may use what the memory ceiling leaves.
        self._import_lock = pool.import_lock if pool is not None else threading.Lock()
        # Free space in a model dir; a seam so a test can cap it below a repo's size.
        self.disk_free = disk_free
        self._python, self._max_parallel = python, max_parallel
        self._state_path = settings.base_path / STATE_FILE
        self._tasks: dict[str, DownloadTask] = {}
        self._runs: dict[str, DownloadRun] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False

    # -- API -------------------------------------------------------------------

    def start(self) -> None:
        """Load the saved tasks; unfinished ones run again (the server's start)."""
        with self._lock:
            for task in _load_tasks(self._state_path):
                self._tasks[task.id] = task
                if task.active:
                    self._restore(task)
            if self._tasks:
                self._save()
            self._pump()

    def inspect(self, repo_id: str, revision: str | None, baseline: int = 0) -> dict[str, Any]:
        free = self.disk_free(self.settings.model_dirs[0])
        return inspect_summary(self.settings, repo_id, revision, free_bytes=free, baseline=baseline)

    def submit(
        self,
        repo_id: str,
        revision: str | None,
        name: str | None,
        baseline: int = 0,
        *,
        gguf_file: str | None = None,
        dtype: str | None = None,
    ) -> dict[str, Any]:
        """Plan (network, no lock held), then queue; 400/401/403/404/409/502/507.
        With ``gguf_file``: that one file, imported into the model folder."""
        with self._lock:
            reserved = sum(t.bytes_total - t.bytes_done for t in self._tasks.values() if t.active)
        plan = plan_download(
            self.settings,
            repo_id,
            revision,
            name,
            free_bytes=self.disk_free(self.settings.model_dirs[0]),
            reserved_bytes=max(0, reserved),
            baseline_bytes=baseline,
            gguf_file=gguf_file,
            dtype=dtype,
        )
        with self._lock:
            self._check_not_queued(plan)
            task = _task_for(plan)
            task.baseline_bytes = baseline
            self._tasks[task.id] = task
            log.info("download %s: %s -> %s", task.id, task.repo_id, task.dest)
            self._save()
            self._pump()
            return task.to_dict()

    def list(self) -> list[dict[str, Any]]:
        """Every task, newest first."""
        with self._lock:
            return [t.to_dict() for t in reversed(self._tasks.values())]

    def get(self, task_id: str) -> dict[str, Any]:
        with self._lock:
            return self._task(task_id).to_dict()

    def cancel(self, task_id: str, wait_s: float = 10.0) -> dict[str, Any]:
        """Stop a queued or running download; its partial folder stays for a later
        download of the same name. Cancelling a finished task changes nothing."""
        with self._lock:
            task = self._task(task_id)
            if task.phase == "queued":
                self._end(task, "cancelled", None)
            elif task.phase in ("downloading", "importing"):
                task.cancel_requested = True
                self._stop_children(task_id)
            self._changed.wait_for(lambda: not task.active, timeout=wait_s)
            return task.to_dict()

    def delete(self, task_id: str) -> None:
        """Forget a finished task; a failed or cancelled one's partial files go too."""
        with self._lock:
            task = self._task(task_id)
            if task.active:
                raise TaskConflictError(
                    f"download {task_id} is {task.phase}; cancel it before deleting it"
                )
            del self._tasks[task_id]
            in_use = any(t.active and t.dest == task.dest for t in self._tasks.values())
            if task.phase != "done" and not in_use:
                shutil.rmtree(partial_dir_for(task.dest), ignore_errors=True)
            self._save()

    def shutdown(self, timeout_s: float = 15.0) -> None:
        """Stop the children; running tasks stay saved as unfinished, to resume."""
        with self._lock:
            self._closed = True
            for task_id in list(self._runs) + list(self._import_pids):
                self._stop_children(task_id)
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout_s)
        with self._lock:
            self._save()

    # -- internals (lock held unless said) ---------------------------------------

    def _task(self, task_id: str) -> DownloadTask:
        task = self._tasks.get(task_id)
        if task is None:
            raise NotFoundError(f"no download with id '{task_id}'", param="id")
        return task

    def _check_not_queued(self, plan: DownloadPlan) -> None:
        if any(t.active and t.dest == plan.dest for t in self._tasks.values()):
            raise OutputExistsError(
                f"a queued or running download already writes '{plan.name}'", param="name"
            )

    def _stop_children(self, task_id: str) -> None:
        """End the task's download worker or import child (whichever runs)."""
        run = self._runs.get(task_id)
        if run is not None:
            run.stop()
        pid = self._import_pids.get(task_id)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _pump(self) -> None:
        running = sum(t.phase in RUNNING_PHASES for t in self._tasks.values())
        for task in self._tasks.values():
            if self._closed or running >= self._max_parallel:
                return
            if task.phase == "queued":
                task.phase, running = "downloading", running + 1
                thread = threading.Thread(
                    target=self._run, args=(task,), name=f"download-{task.id}", daemon=True
                )
                self._threads[task.id] = thread
                thread.start()

    def _run(self, task: DownloadTask) -> None:
        """Runner thread: the child, its progress, then the rename."""
        run = DownloadRun(task.plan(), HubAccess.from_settings(self.settings), self._python)
        try:
            run.start()
        except OSError as exc:
            with self._lock:
                self._end(task, "failed", f"cannot start the download: {exc}")
            return
        with self._lock:
            self._runs[task.id] = run
            if task.cancel_requested or self._closed:
                run.stop()
        while run.running():
            done, speed = run.progress()
            with self._lock:
                task.bytes_done, task.speed_bps = done, speed
            time.sleep(POLL_S)
        self._after_child(task, run, run.error())

    def _after_child(self, task: DownloadTask, run: DownloadRun, error: str | None) -> None:
        with self._lock:
            self._runs.pop(task.id, None)
            task.bytes_done, task.speed_bps = run.progress()[0], 0.0
            if task.cancel_requested:
                return self._end(task, "cancelled", None)
            if self._closed:  # server stopping: stays unfinished, resumes at the next start
                return
            if error is not None:
                return self._end(task, "failed", error)
            if task.gguf_file is not None:
                task.phase = "importing"
                self._save()
            else:
                task.phase = "finishing"
        if task.gguf_file is not None:
            return self._import(task, run.partial)
        try:
            finish(run.partial, task.dest)
        except (OmlxError, OSError) as exc:
            with self._lock:
                return self._end(task, "failed", getattr(exc, "message", str(exc)))
        with self._lock:
            task.bytes_done = task.bytes_total
            self._end(task, "done", None)

    # -- a GGUF task's import ------------------------------------------------------

    def _import(self, task: DownloadTask, partial: Path) -> None:
        """Runner thread: the downloaded GGUF into the model folder, in a child."""
        assert task.gguf_file is not None
        try:
            source = downloaded_gguf(partial, task.gguf_file)
            remove_import_leftovers(task.dest)
            folder = task.dest.parent
            dtype = resolved_dtype(task.dtype)
            check_import_disk(source, dtype, folder, self.disk_free(folder))
            conversion = self._run_import(task, source, dtype)
        except (OmlxError, OSError) as exc:
            return self._import_failed(task, partial, getattr(exc, "message", str(exc)))
        drop_download(partial, task.dest)
        fit = folder_fit(task.dest, self.settings, task.baseline_bytes)
        with self._lock:
            task.result, task.fit = import_result(conversion, task.gguf_file), fit
            task.bytes_done = task.bytes_total
            self._end(task, "done", None)

    def _run_import(self, task: DownloadTask, source: Path, dtype: str) -> dict[str, Any]:
        from omlx.models.import_child import import_memory_limit, run_in_child

        with self._import_lock:
            limit = resource.RLIM_INFINITY
            if self._pool is not None:  # what the memory ceiling leaves, as the import route
                used = self._pool.probe.reading(fresh=True).resident_bytes
                limit = import_memory_limit(self._pool.limits.hard_bytes, used)
            tracker = _ImportTracker(self, task)
            args = (str(source), str(task.dest), dtype)
            conversion: dict[str, Any] = run_in_child(
                import_job, *args, memory_limit_bytes=limit, tracker=tracker
            )
        return conversion

    def _import_failed(self, task: DownloadTask, partial: Path, error: str) -> None:
        """Nothing half-made stays; the GGUF stays only for a cancel (a later download
        of the name skips it) or a server stop (the task resumes with it)."""
        remove_import_leftovers(task.dest)
        with self._lock:
            if task.cancel_requested:
                return self._end(task, "cancelled", None)
            if self._closed:
                return
            drop_download(partial, task.dest)
            self._end(task, "failed", error)

    def _end(self, task: DownloadTask, phase: str, error: str | None) -> None:
        task.phase, task.error, task.finished_at = phase, error, time.time()
        task.speed_bps = 0.0
        self._threads.pop(task.id, None)
        log.info("download %s %s%s", task.id, phase, f": {error}" if error else "")
        self._save()
        self._changed.notify_all()
        self._pump()

    def _restore(self, task: DownloadTask) -> None:
        """A task the last server left unfinished: resume it, or say why it cannot."""
        partial = partial_dir_for(task.dest)
        imported = task.gguf_file is not None and (task.dest / "config.json").is_file()
        if imported or (task.dest.is_dir() and not partial.exists()):  # just before the stop
            if imported:
                drop_download(partial, task.dest)
            task.phase, task.bytes_done, task.finished_at = "done", task.bytes_total, time.time()
        elif task.dest.exists():
            task.phase, task.finished_at = "failed", time.time()
            task.error = (
                f"a folder named '{task.name}' appeared in {task.dest.parent} while omlx was "
                "stopped; download again with another name"
            )
        else:
            log.info("download %s: resuming %s after a restart", task.id, task.repo_id)
            task.phase, task.speed_bps = "queued", 0.0

    def _save(self) -> None:
        try:
            write_json_atomic(
                self._state_path, {"downloads": [t.record() for t in self._tasks.values()]}
            )
        except OSError as exc:
            log.warning("cannot save downloads to %s: %s", self._state_path, exc)


class _ImportTracker:
    """The import child's pid, for cancel and shutdown; forwarded to the server's
    memory probe, in which the child counts while it runs."""

    def __init__(self, manager: DownloadManager, task: DownloadTask):
        self._manager, self._task = manager, task

    def track_process(self, pid: int) -> None:
        manager = self._manager
        if manager._pool is not None:
            manager._pool.probe.track_process(pid)
        with manager._lock:
            manager._import_pids[self._task.id] = pid
            if self._task.cancel_requested or manager._closed:  # asked before it started
                manager._stop_children(self._task.id)

    def untrack_process(self, pid: int) -> None:
        manager = self._manager
        with manager._lock:
            manager._import_pids.pop(self._task.id, None)
        if manager._pool is not None:
            manager._pool.probe.untrack_process(pid)


def _load_tasks(path: Path) -> list[DownloadTask]:
    try:
        records = read_settings_file(path).get("downloads", [])
    except OmlxError as exc:
        log.warning("ignoring %s: %s", path, exc.message)
        return []
    tasks = []
    for record in records if isinstance(records, list) else []:
        try:
            tasks.append(DownloadTask.from_record(record))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring a download record in %s: %r", path, exc)
    return tasks


def _task_for(plan: DownloadPlan) -> DownloadTask:
    return DownloadTask(
        id=uuid.uuid4().hex[:12],
        repo_id=plan.repo_id,
        revision=plan.revision,
        commit=plan.commit,
        name=plan.name,
        dest=plan.dest,
        bytes_total=plan.bytes_total,
        fit=plan.fit,
        gguf_file=plan.gguf_file,
        dtype=plan.dtype,
    )
