"""``python -m omlx.models.download_worker``: one Hub download in a child process.

huggingface_hub's ``snapshot_download`` (or, for a GGUF import, ``hf_hub_download`` of
the one file) into a hidden partial folder (its local-dir mode: files that finished are
kept with their metadata and skipped by the next run).
A child, so cancel is immediate (SIGTERM or SIGINT end it at once: a download thread
cannot be interrupted in-process) and the server's event loop never waits on the
network. The token arrives on stdin, never in argv or the environment of others;
stdin then stays open, and its end (the parent gone, even killed) ends the child.
Output: one JSON line, ``{"event": "done"}`` or ``{"event": "error", "message": ...}``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import sys
import threading
from pathlib import Path

from omlx.errors import OmlxError
from omlx.models.hub import IGNORE_PATTERNS, HubAccess, hub_errors

# Files one after another: a cancel or crash then loses at most the file in flight
# (huggingface_hub 2.4 discards a partly downloaded file; whole files are kept).
FILE_WORKERS = 1


def remove_stale_temp_files(partial: Path) -> None:
    """Temp files of a run that was killed: never resumed by huggingface_hub, so
    they only take disk space and would inflate the progress count."""
    for stale in (partial / ".cache" / "huggingface" / "download").rglob("*.incomplete"):
        stale.unlink(missing_ok=True)


def download(
    repo_id: str, commit: str, partial: Path, access: HubAccess, filename: str | None = None
) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars  # type: ignore[attr-defined]

    disable_progress_bars()
    partial.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(partial)
    with hub_errors(access, repo_id):
        snapshot_download(
            repo_id,
            revision=commit,
            local_dir=partial,
            cache_dir=access.cache_dir,
            endpoint=access.endpoint,
            token=access.token,
            # A GGUF pull wants its one file; a model pull everything but the ignored.
            allow_patterns=[glob.escape(filename)] if filename is not None else None,
            ignore_patterns=None if filename is not None else IGNORE_PATTERNS,
            max_workers=FILE_WORKERS,
        )


def _exit_when_parent_is_gone() -> None:
    sys.stdin.read()  # the parent never writes again: EOF means it closed or died
    os._exit(1)  # no cleanup to wait for: the partial folder is resumable as it is


def main(argv: list[str] | None = None) -> int:
    # Die at once on either signal (the default for SIGTERM): the pool's threads would
    # otherwise finish their file before a KeyboardInterrupt could end the process.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    parser = argparse.ArgumentParser(prog="omlx.models.download_worker")
    parser.add_argument("repo_id")
    parser.add_argument("commit")
    parser.add_argument("partial", type=Path)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--file", help="download this one file only (a GGUF to import)")
    args = parser.parse_args(argv)
    token = sys.stdin.readline().strip() or None
    threading.Thread(target=_exit_when_parent_is_gone, daemon=True).start()
    try:
        access = HubAccess(args.endpoint, token, args.cache_dir)
        download(args.repo_id, args.commit, args.partial, access, args.file)
    except OmlxError as exc:
        print(json.dumps({"event": "error", "message": exc.message}), flush=True)
        return 1
    except OSError as exc:  # disk full, permissions: the words, not a traceback
        print(json.dumps({"event": "error", "message": f"{exc}"}), flush=True)
        return 1
    print(json.dumps({"event": "done"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
