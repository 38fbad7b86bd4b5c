"""The load-time batching verdict, kept between starts (issue 41; suite time, issue 38).

Whether a model can share the batch is decided at load by forwards on the real model
(unbatched.batch_probe, output_probe.py): a second of a small model's load, more on a
large one. The answer depends only on the model's files and the code and machine that
run them, so it is kept like the auto-profile (profile_cache.py): one JSON file per
model folder and key in ``<base>/profiles/batching/`` (the newest few of a model
kept), reused only when its key is the same: the model's files (name, size,
modification time), its kind, how the probe's runner runs it (activation width, KV
quantization, prefill chunk, execution strategy), the omlx, MLX, mlx-lm and mlx-vlm
versions and the machine. Anything else probes again into an entry of its own. A
file that does not parse or holds no verdict is ignored with a warning: it only ever
saves seconds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from omlx import __version__
from omlx.engine.arch_probe import package_version
from omlx.engine.profile_cache import (
    entry_path,
    keep_newest_entries,
    machine_signature,
    mark_used,
    model_files,
)
from omlx.models.discovery import ModelInfo
from omlx.settings import write_json_atomic

log = logging.getLogger(__name__)

# Bumped when the probes change what they find: older verdicts are probed again.
FORMAT = 1


def batching_key(info: ModelInfo, runner: dict[str, Any]) -> dict[str, Any]:
    """Everything the batching probes of ``info`` depend on, as plain JSON values;
    ``runner``: how the probe's runner runs it (activation width, KV quantization,
    prefill chunk, execution strategy)."""
    return {
        "format": FORMAT,
        "omlx": __version__,
        "mlx": getattr(mx, "__version__", "unknown"),
        "mlx_lm": package_version("mlx-lm"),
        "mlx_vlm": package_version("mlx-vlm") if info.kind == "vlm" else "-",
        "machine": machine_signature(),
        "model": {"path": str(info.path.resolve()), "kind": info.kind},
        "files": model_files(info.path),
        "runner": runner,
    }


class BatchingVerdicts:
    """Verdicts by model folder, in ``folder`` (beside the auto-profiles)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def path_for(self, model_path: Path, key: dict[str, Any]) -> Path:
        return entry_path(self.folder, model_path, key)

    def probe_or_reuse(
        self, key: dict[str, Any], model_path: Path, probe: Callable[[], str | None]
    ) -> tuple[str | None, bool]:
        """The stored verdict when its key is ``key``, else ``probe()`` (stored after).
        A verdict is None (the model batches) or why it cannot. Returns (verdict,
        whether it was reused)."""
        path = self.path_for(model_path, key)
        stored = self._read(path, key, model_path.name)
        if stored is not None:
            reason = stored["reason"]
            mark_used(path)
            log.info(
                "batching verdict of %s reused from %s: %s",
                model_path.name,
                path,
                reason or "batches",
            )
            return reason, True
        reason = probe()
        try:
            write_json_atomic(path, {"key": key, "reason": reason})
        except OSError as exc:  # a read-only or full disk costs the next load the probe
            log.warning("could not keep the batching verdict of %s: %s", model_path.name, exc)
        keep_newest_entries(self.folder, model_path)
        return reason, False

    def _read(self, path: Path, key: dict[str, Any], model: str) -> dict[str, Any] | None:
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring the batching verdict of %s (%s): %s", model, path, exc)
            return None
        if not isinstance(entry, dict) or entry.get("key") != key:
            return None  # another model, version or machine: probe again
        reason = entry.get("reason")
        if reason is not None and not isinstance(reason, str):
            log.warning("ignoring the batching verdict of %s (%s): malformed", model, path)
            return None
        return entry
