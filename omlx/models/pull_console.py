"""`omlx pull REPO_ID` and `omlx models rm NAME`: Hub downloads from the command line.

The pull is planned like the server's (every refusal before a byte moves), then the
worker child downloads into the hidden partial folder while a bar shows bytes, speed
and ETA. Ctrl-C stops the child and keeps the partial folder; the same pull resumes.
``--gguf FILE`` downloads one GGUF of the repo and imports it into the model folder.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import TextIO

from omlx.errors import ModelNotFoundError, OmlxError
from omlx.models.discovery import discover_models
from omlx.models.downloads import (
    IMPORT_DTYPES,
    DownloadPlan,
    DownloadRun,
    disk_free_bytes,
    finish,
    partial_dir_for,
    plan_download,
)
from omlx.models.gguf_pull import (
    check_import_disk,
    conversion_lines,
    downloaded_gguf,
    drop_download,
    folder_fit,
    import_job,
    remove_import_leftovers,
    resolved_dtype,
)
from omlx.models.hub import HubAccess
from omlx.settings import Settings

BAR_WIDTH = 30
REDRAW_S = 0.2


def add_pull_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    pull = sub.add_parser("pull", help="download an MLX model from the Hugging Face Hub")
    pull.add_argument("repo_id", help="e.g. mlx-community/Qwen3-0.6B-4bit")
    pull.add_argument("--revision", help="branch, tag or commit (default: main)")
    pull.add_argument("--name", help="model folder name (default: the repo's name, or the GGUF's)")
    pull.add_argument(
        "--gguf", metavar="FILE", help="download this .gguf of the repo and import it"
    )
    pull.add_argument(
        "--dtype",
        choices=IMPORT_DTYPES,
        help="with --gguf: what the import makes of the weights (default: keep on a "
        "Mac's GPU, float32 elsewhere)",
    )


class ByteBar:
    """``[#########.........]  31%  120.0/384.0 MB  45.2 MB/s  0:06 left``, in place."""

    def __init__(self, total_bytes: int, out: TextIO = sys.stderr):
        self._total, self._out = max(1, total_bytes), out
        self._drawn = False

    def draw(self, done: int, speed_bps: float) -> None:
        fraction = min(1.0, done / self._total)
        filled = int(BAR_WIDTH * fraction)
        left = ""
        if speed_bps > 0 and done < self._total:
            left = f"{_clock((self._total - done) / speed_bps)} left"
        self._out.write(
            f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {100 * fraction:3.0f}%  "
            f"{done / 1e6:.1f}/{self._total / 1e6:.1f} MB  {speed_bps / 1e6:.1f} MB/s  {left:<12}"
        )
        self._out.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self._out.write("\n")
            self._out.flush()
            self._drawn = False


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def pull_command(args: argparse.Namespace, settings: Settings) -> int:
    free = disk_free_bytes(settings.model_dirs[0])
    plan = plan_download(
        settings,
        args.repo_id,
        args.revision,
        args.name,
        free_bytes=free,
        gguf_file=args.gguf,
        dtype=args.dtype,
    )
    what = f" {plan.gguf_file}" if plan.gguf_file else ""
    print(f"{plan.repo_id}{what} ({plan.revision}): {plan.bytes_total / 1e6:.1f} MB -> {plan.dest}")
    if plan.fit is not None:
        print(f"  memory: {plan.fit['message']}")
    run = DownloadRun(plan, HubAccess.from_settings(settings))
    run.start()
    if not _follow(run, plan.bytes_total):
        return 130
    error = run.error()
    if error is not None:
        raise OmlxError(f"download failed: {error} (the files so far stay in {run.partial})")
    if plan.gguf_file is not None:
        return _import_pulled(plan, run, settings)
    finish(run.partial, plan.dest)
    print(f"{plan.repo_id} -> {plan.dest} (name: {plan.name})")
    return 0


def _follow(run: DownloadRun, total_bytes: int) -> bool:
    """Draw the bar until the child ends; False when Ctrl-C stopped it."""
    bar = ByteBar(total_bytes)
    try:
        while run.running():
            bar.draw(*run.progress())
            time.sleep(REDRAW_S)
    except KeyboardInterrupt:
        run.stop()
        run.error()  # waits for the child
        bar.close()
        print(
            f"omlx: download stopped; {run.progress()[0] / 1e6:.1f} MB kept in {run.partial} "
            "(hidden): run the same `omlx pull` to resume",
            file=sys.stderr,
        )
        return False
    bar.draw(run.progress()[0], 0.0)
    bar.close()
    return True


def _import_pulled(plan: DownloadPlan, run: DownloadRun, settings: Settings) -> int:
    """The downloaded GGUF into the model folder (in this process, as `omlx models
    import-gguf` does); the GGUF goes afterwards, as it does when the import fails."""
    assert plan.gguf_file is not None
    source = downloaded_gguf(run.partial, plan.gguf_file)
    dtype = resolved_dtype(plan.dtype)
    print(f"importing {plan.gguf_file} as {dtype} -> {plan.dest} ...", flush=True)
    remove_import_leftovers(plan.dest)
    try:
        check_import_disk(source, dtype, plan.dest.parent, disk_free_bytes(plan.dest.parent))
        conversion = import_job(str(source), str(plan.dest), dtype)
    except KeyboardInterrupt:
        remove_import_leftovers(plan.dest)
        print("omlx: import stopped; the GGUF stays for the next pull", file=sys.stderr)
        return 130
    except OmlxError:
        drop_download(run.partial, plan.dest)
        raise
    drop_download(run.partial, plan.dest)
    print(
        f"imported {plan.gguf_file} -> {plan.dest} ({conversion['model_type']}, "
        f"{conversion['dtype']}) in {conversion['seconds']:.1f} s; the GGUF was removed"
    )
    for line in conversion_lines(conversion):
        print(f"  {line}")
    fit = folder_fit(plan.dest, settings, 0)
    if fit is not None:
        print(f"  memory: {fit['message']}")
    return 0


def remove_model(settings: Settings, name: str) -> int:
    """Delete a model folder found in the model dirs (or an unfinished download)."""
    models = discover_models(settings.model_dirs)
    info = models.get(name)
    if info is None:
        partial = partial_dir_for(settings.model_dirs[0] / name)
        if "/" not in name and partial.is_dir():
            shutil.rmtree(partial)
            print(f"removed the unfinished download of {name} ({partial})")
            return 0
        raise ModelNotFoundError(name, sorted(models))
    if info.path.is_symlink():
        info.path.unlink()
    else:
        shutil.rmtree(info.path)
    print(f"removed {name} ({info.path})")
    return 0
