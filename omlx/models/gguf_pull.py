"""After a GGUF download: import the file into the model folder, then drop the GGUF.

A GGUF file of a Hub repo is downloaded like a model (the one file, into the hidden
partial folder), then ``omlx.models.gguf`` converts it into ``<name>``: the importer
writes a hidden temp folder and renames it into place, so nothing half-made is ever
listed. The GGUF is removed afterwards, whether the import worked or not: omlx serves
the MLX folder, a kept copy would double the disk the model takes, and a file the
importer refused is of no use here (it stays on the Hub).

Free disk space is checked twice: for the GGUF before the download (its size is all the
Hub tells), then for the import's output once the header can be read (``check_import_disk``).
The model's fit is computed from the imported folder: only there are its config (read
from the GGUF's header) and its weights' size (which the chosen dtype decides) known.
"""

from __future__ import annotations

import glob
import json
import math
import shutil
from pathlib import Path
from typing import Any

from omlx.errors import OmlxError
from omlx.settings import Settings


def downloaded_gguf(partial: Path, gguf_file: str) -> Path:
    """The GGUF the worker child wrote into the partial folder."""
    path = partial / gguf_file
    if not path.is_file():
        raise OmlxError(f"the download in {partial} has no {gguf_file}")
    return path


def resolved_dtype(dtype: str | None) -> str:
    """The dtype an import makes: as asked, else the platform's default."""
    from omlx.models.builtin import default_dtype

    return dtype or default_dtype()


def import_bytes(source: Path, dtype: str) -> int:
    """About what the import writes: every weight as float32 / float16, or, kept
    quantized, about the GGUF's own size."""
    from omlx.models.gguf_reader import read_header

    if dtype == "keep":
        return source.stat().st_size
    elements = sum(math.prod(t.shape) for t in read_header(source).tensors)
    return elements * (4 if dtype == "float32" else 2)


def check_import_disk(source: Path, dtype: str, folder: Path, free_bytes: int) -> None:
    """507 before the import starts when its output cannot fit on the disk."""
    from omlx.models.downloads import InsufficientDiskError

    needed = import_bytes(source, dtype)
    if free_bytes < needed:
        raise InsufficientDiskError(
            f"not enough disk space in {folder} to import {source.name} as {dtype}: it "
            f"needs about {needed / 1e9:.2f} GB, {free_bytes / 1e9:.2f} GB is free; free some "
            "space, or import with dtype 'keep' (smaller)",
            needed_bytes=needed,
            free_bytes=free_bytes,
        )


def import_job(source: str, target: str, dtype: str | None) -> dict[str, Any]:
    """Convert ``source`` into the folder ``target``; run in the import child (by the
    admin panel's import route and by a GGUF download alike)."""
    from omlx.models.gguf import convert_gguf

    # The caller checked dtype; convert_gguf checks it again.
    result = convert_gguf(Path(source), Path(target), dtype=resolved_dtype(dtype))  # type: ignore[arg-type]
    return result.as_dict()


def remove_import_leftovers(dest: Path) -> None:
    """A stopped import child leaves its hidden temp folder ``.<name>.importing-*``."""
    for leftover in dest.parent.glob(f".{glob.escape(dest.name)}.importing-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def drop_download(partial: Path, dest: Path) -> None:
    """The downloaded GGUF and its partial folder go, with any half-written import."""
    shutil.rmtree(partial, ignore_errors=True)
    remove_import_leftovers(dest)


def import_result(conversion: dict[str, Any], gguf_file: str) -> dict[str, Any]:
    """A finished GGUF task's ``result``: what became of each tensor type, and that
    the downloaded GGUF is gone."""
    return {
        "conversion": conversion,
        "gguf_removed": True,
        "note": f"{gguf_file} was removed after the import: the model is the MLX folder",
    }


def folder_fit(folder: Path, settings: Settings, baseline_bytes: int) -> dict[str, Any] | None:
    """The fit estimate of an imported folder (None when it cannot be read)."""
    from omlx.models.downloads import fit_dict

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    except (OSError, ValueError):
        return None
    return fit_dict(config if isinstance(config, dict) else None, weights, settings, baseline_bytes)


def conversion_lines(conversion: dict[str, Any]) -> list[str]:
    """``Q4_K: 11 tensors kept as MLX 4-bit affine, group 32 (exact)``, one per type."""
    types = conversion.get("tensor_types") or {}
    return [f"{kind}: {what['tensors']} tensors {what['became']}" for kind, what in types.items()]
