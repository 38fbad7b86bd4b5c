"""Model downloads from the Hub into the first model dir, beside serving.

A download is planned before a byte moves (``plan_download``: the repo inspected, the
name checked, free disk space and the fit estimate computed), then runs in a child
process (``omlx.models.download_worker``) writing into a hidden partial folder
``.<name>.download-partial``; discovery skips hidden folders, so nothing half-written
is ever listed as a model. When every file is there the folder is checked and renamed
to ``<name>`` in one step. Cancel (or Ctrl-C in ``omlx pull``) ends the child and keeps
the partial folder: the next download of that name skips the files it already has.

The server's tasks are in ``omlx.models.download_tasks``; ``omlx pull`` in
``omlx.models.pull_console``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx.errors import (
    InvalidRequestError,
    OmlxError,
    OutputExistsError,
)
from omlx.models.discovery import discover_models
from omlx.models.folder_name import check_folder_name
from omlx.models.hub import (
    HubAccess,
    RepoInspection,
    inspect_gguf_file,
    inspect_repo,
    search_models,
)
from omlx.settings import Settings

log = logging.getLogger(__name__)

SPEED_WINDOW_S = 5.0
PARTIAL_SUFFIX = ".download-partial"
MARKER = ".cache/omlx-download.json"  # which repo (and GGUF file) a partial folder holds
IMPORT_DTYPES = ("float32", "float16", "keep")


class InsufficientDiskError(OmlxError):
    """Not enough free disk space in the model dir for the download."""

    http_status = 507
    error_type = "insufficient_storage"
    code = "insufficient_disk"

    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.free_bytes = needed_bytes, free_bytes

    def extra_fields(self) -> dict[str, object]:
        return {"needed_bytes": self.needed_bytes, "free_bytes": self.free_bytes}


def disk_free_bytes(path: Path) -> int:
    """Bytes an unprivileged user may still write on ``path``'s file system."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stats = os.statvfs(probe)
    return stats.f_bavail * stats.f_frsize


# -- names and folders ---------------------------------------------------------


def check_name(name: object) -> str:
    """One safe, visible folder name; 400 naming the problem otherwise."""
    return check_folder_name(name, "name")


def default_name(repo_id: str, gguf_file: str | None = None) -> str:
    """``Qwen3-0.6B-4bit`` for ``mlx-community/Qwen3-0.6B-4bit``; a GGUF import is
    named after its file, as ``omlx models import-gguf`` names it: ``qwen3.Q4_K_M``."""
    if gguf_file is not None:
        return gguf_file.rsplit("/", 1)[-1].removesuffix(".gguf").removesuffix(".GGUF")
    return repo_id.rsplit("/", 1)[-1]


def partial_dir_for(dest: Path) -> Path:
    return dest.parent / f".{dest.name}{PARTIAL_SUFFIX}"


def check_name_free(settings: Settings, name: str) -> Path:
    """The destination in the first model dir; 409 when a model or folder has the name."""
    dest = settings.model_dirs[0] / name
    taken = dest.exists() or dest.is_symlink()
    if taken or name in discover_models(settings.model_dirs):
        where = dest.parent if taken else "a model dir"
        raise OutputExistsError(
            f"a model named '{name}' already exists in {where}: pass another 'name' "
            "(omlx pull --name NAME), or remove it first (omlx models rm NAME)",
            param="name",
        )
    return dest


def partial_bytes(partial: Path) -> int:
    """Bytes downloaded so far: finished files plus huggingface_hub's temp files
    (its metadata and locks under .cache are not counted)."""
    total = 0
    for root, _dirs, files in os.walk(partial):
        in_cache = ".cache" in Path(root).relative_to(partial).parts
        for name in files:
            if in_cache and not name.endswith(".incomplete"):
                continue
            with contextlib.suppress(OSError):  # renamed or removed since the listing
                total += (Path(root) / name).stat().st_size
    return total


def claim_partial(partial: Path, repo_id: str, gguf_file: str | None = None) -> None:
    """Keep a partial folder only if it holds ``repo_id`` (and the same GGUF file):
    another download's files under the same name would mix in; mark it as this one's."""
    if partial.exists() and not _partial_holds(partial, repo_id, gguf_file):
        shutil.rmtree(partial, ignore_errors=True)
    marker = partial / MARKER
    marker.parent.mkdir(parents=True, exist_ok=True)
    held = {"repo_id": repo_id, "gguf_file": gguf_file}
    marker.write_text(json.dumps(held), encoding="utf-8")


def finish(partial: Path, dest: Path) -> None:
    """Check the downloaded folder is a model and rename it into place in one step."""
    if not (partial / "config.json").is_file() or not any(partial.glob("*.safetensors")):
        raise OmlxError(f"the download in {partial} has no config.json or safetensors weights")
    if dest.exists() or dest.is_symlink():
        raise OutputExistsError(
            f"a folder named '{dest.name}' appeared in {dest.parent} during the download; "
            f"the files stay in {partial}: download again with another name"
        )
    # huggingface_hub's bookkeeping and the repo marker: a plain model folder remains.
    shutil.rmtree(partial / ".cache", ignore_errors=True)
    os.rename(partial, dest)


# -- planning ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DownloadPlan:
    repo_id: str
    revision: str
    commit: str
    name: str
    dest: Path
    bytes_total: int
    fit: dict[str, Any] | None
    # A GGUF import: the one file downloaded, and the dtype the import makes of it.
    gguf_file: str | None = None
    dtype: str | None = None


def fit_dict(
    config: dict[str, Any] | None, weights_bytes: int | None, settings: Settings, baseline: int
) -> dict[str, Any] | None:
    """The fit estimate's dict (omlx.memory.fit); None without a config or weights size."""
    if config is None or not weights_bytes:
        return None
    from omlx.memory.fit import fit_for_settings

    try:
        fit = fit_for_settings(config, weights_bytes, settings, baseline_bytes=baseline)
    except (OmlxError, ValueError, TypeError, KeyError) as exc:
        log.warning("no fit estimate for a config of type %s: %s", config.get("model_type"), exc)
        return None
    return fit.as_dict()


def inspect_summary(
    settings: Settings, repo_id: str, revision: str | None, *, free_bytes: int, baseline: int = 0
) -> dict[str, Any]:
    """What POST .../downloads/inspect answers."""
    inspection = inspect_repo(HubAccess.from_settings(settings), repo_id, revision)
    return {
        **inspection.as_dict(),
        "fit": fit_dict(inspection.config, inspection.weights_bytes, settings, baseline),
        "disk_free_bytes": free_bytes,
    }


def search_summary(settings: Settings, query: str, limit: int, baseline: int = 0) -> Any:
    """What GET /admin/api/hub/search answers: MLX models, most downloaded first."""
    hits = search_models(HubAccess.from_settings(settings), query, limit)
    return [
        {
            "repo_id": hit.repo_id,
            "downloads": hit.downloads,
            "likes": hit.likes,
            "size_bytes": hit.size_bytes,
            "quantization": hit.quantization,
            "fit": fit_dict(hit.config, hit.size_bytes, settings, baseline),
        }
        for hit in hits
    ]


def plan_download(
    settings: Settings,
    repo_id: str,
    revision: str | None,
    name: str | None,
    *,
    free_bytes: int,
    reserved_bytes: int = 0,
    baseline_bytes: int = 0,
    gguf_file: str | None = None,
    dtype: str | None = None,
) -> DownloadPlan:
    """Everything checked before a byte moves: 400 / 404 / 401 / 403 / 409 / 502 / 507.

    With ``gguf_file``, only that file of the repo is planned, for a GGUF import."""
    _check_import_args(gguf_file, dtype)
    if name is not None:  # a bad or taken name is refused before the Hub is asked
        check_name_free(settings, check_name(name))
    access = HubAccess.from_settings(settings)
    if gguf_file is not None:
        inspection = inspect_gguf_file(access, repo_id, revision, gguf_file)
    else:
        inspection = inspect_repo(access, repo_id, revision)
        if inspection.kind == "gguf":
            raise _gguf_repo(inspection)
    final = check_name(name if name is not None else default_name(inspection.repo_id, gguf_file))
    dest = check_name_free(settings, final)
    partial = partial_dir_for(dest)
    have = partial_bytes(partial) if _partial_holds(partial, repo_id, gguf_file) else 0
    _check_disk(dest.parent, max(0, inspection.total_bytes - have) + reserved_bytes, free_bytes)
    # A GGUF's fit is known once its header is here: the task computes it after the import.
    fit = fit_dict(inspection.config, inspection.weights_bytes, settings, baseline_bytes)
    return DownloadPlan(
        inspection.repo_id,
        inspection.revision,
        inspection.commit,
        final,
        dest,
        inspection.total_bytes,
        fit,
        gguf_file,
        dtype,
    )


def _check_import_args(gguf_file: str | None, dtype: str | None) -> None:
    if gguf_file is not None and (not gguf_file or not gguf_file.lower().endswith(".gguf")):
        raise InvalidRequestError(
            f"'gguf_file' must name a .gguf file of the repo, not {gguf_file!r}",
            param="gguf_file",
        )
    if dtype is not None and gguf_file is None:
        raise InvalidRequestError(
            "'dtype' applies to a GGUF import only: pass it with 'gguf_file'", param="dtype"
        )
    if dtype is not None and dtype not in IMPORT_DTYPES:
        raise InvalidRequestError(
            f"'dtype' must be one of {', '.join(IMPORT_DTYPES)}, not {dtype!r}", param="dtype"
        )


def _gguf_repo(inspection: RepoInspection) -> InvalidRequestError:
    files = ", ".join(f.name for f in inspection.gguf_files[:5])
    return InvalidRequestError(
        f"'{inspection.repo_id}' holds GGUF files, not an MLX model: pass one of {files} as "
        "'gguf_file' to download and import it (omlx pull REPO_ID --gguf FILE)",
        param="repo_id",
        code="gguf_repo",
    )


def _check_disk(folder: Path, needed: int, free: int) -> None:
    if free < needed:
        raise InsufficientDiskError(
            f"not enough disk space in {folder}: the download needs {_gb(needed)}, "
            f"{_gb(free)} is free; free some space or put another folder first in "
            "models.model_dirs",
            needed_bytes=needed,
            free_bytes=free,
        )


def _partial_holds(partial: Path, repo_id: str, gguf_file: str | None = None) -> bool:
    try:
        held = json.loads((partial / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(held, dict):
        return False
    return held.get("repo_id") == repo_id and held.get("gguf_file") == gguf_file


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


# -- one running download ------------------------------------------------------------


class RateMeter:
    """Bytes per second over the last few seconds of samples."""

    def __init__(self, window_s: float = SPEED_WINDOW_S):
        self._window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now_s: float, num_bytes: int) -> float:
        self._samples.append((now_s, num_bytes))
        while len(self._samples) > 2 and now_s - self._samples[0][0] > self._window_s:
            self._samples.popleft()
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return max(0.0, (b1 - b0) / (t1 - t0)) if t1 > t0 else 0.0


class DownloadRun:
    """The worker child for one plan, and what it has written so far."""

    def __init__(self, plan: DownloadPlan, access: HubAccess, python: str = sys.executable):
        self.plan, self.partial = plan, partial_dir_for(plan.dest)
        self._access, self._python = access, python
        self._proc: subprocess.Popen[str] | None = None
        self._meter = RateMeter()
        # A file, not a pipe: warnings nobody reads while it runs cannot block the child.
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # noqa: SIM115 (closed in error())
        self._outcome: str | None = None

    def start(self) -> None:
        claim_partial(self.partial, self.plan.repo_id, self.plan.gguf_file)
        cmd = [self._python, "-m", "omlx.models.download_worker", self.plan.repo_id]
        cmd += [self.plan.commit, str(self.partial), "--endpoint", self._access.endpoint]
        if self.plan.gguf_file is not None:
            cmd += ["--file", self.plan.gguf_file]
        if self._access.cache_dir is not None:
            cmd += ["--cache-dir", str(self._access.cache_dir)]
        # Its own session: a terminal's Ctrl-C reaches `omlx pull`, which stops it.
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,  # one JSON line at the end
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write((self._access.token or "") + "\n")
        self._proc.stdin.flush()  # kept open: the child ends when this process does

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def progress(self) -> tuple[int, float]:
        """(bytes on disk, bytes per second lately)."""
        done = partial_bytes(self.partial)
        return done, self._meter.add(time.monotonic(), done)

    def stop(self) -> None:
        if self.running():
            assert self._proc is not None
            self._proc.terminate()

    def error(self) -> str | None:
        """Waits for the child to end: None on success, else why it failed."""
        assert self._proc is not None and self._proc.stdout is not None
        self._proc.wait()
        if self._proc.stdout.closed:  # asked before
            return self._outcome
        self._outcome = self._read_outcome(self._proc.stdout.read(), self._proc.returncode)
        self._proc.stdout.close()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._stderr.close()
        return self._outcome

    def _read_outcome(self, stdout: str, returncode: int) -> str | None:
        for line in stdout.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "error":
                return str(event.get("message"))
        if returncode == 0:
            return None
        self._stderr.seek(0)
        tail = self._stderr.read().strip()[-800:]
        reason = f"the download worker exited with code {returncode}"
        return f"{reason}: {tail}" if tail else reason
