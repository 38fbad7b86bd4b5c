"""The auto-profile's result, kept between starts so an unchanged model skips the stress.

JSON files under ``<base>/profiles/``, one per model folder and key (the newest
``ENTRIES_PER_MODEL`` of a model are kept). An entry is reused only when everything
the measurement depends on is the same: the model's files (name, size, modification
time of each), its kind, the profile's inputs (model dims, the limits, chunk, batch,
vocabulary, explicit capacity, tokens in flight, context window), the MLX and omlx
versions and the machine (architecture, MLX device, RAM), and the profile's format
(a profile from an older format, one lacking a field this one has, is measured
again). Anything else (a changed limit, a re-downloaded model, another Mac) measures
again into an entry of its own, so switching a setting back (``kv_bits``, the
concurrency, a limit) reuses the earlier measurement. A file that does not parse,
names other inputs or has a malformed profile is ignored with a warning, never
trusted: it is only ever a hint that saves seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from omlx import __version__
from omlx.engine.profile import auto_profile, measure_image
from omlx.memory.budget import KVProfile, Limits, ModelDims
from omlx.memory.probe import MemoryProbe, total_ram_bytes
from omlx.mlx_types import LanguageModel
from omlx.models.discovery import ModelInfo
from omlx.settings import write_json_atomic

if TYPE_CHECKING:
    from omlx.models.vlm import VisionEncoder

log = logging.getLogger(__name__)

# Bumped when the profile's meaning or this file's layout changes: older entries re-measure.
# 2: the image pass of VLMs; 3: the widest batched prefill (extrapolated when fewer rows
# ran) and the long-context point (an older entry lacks them: measured again).
FORMAT = 3
_SOURCES = {"measured", "explicit"}


def machine_signature() -> dict[str, Any]:
    """What makes one computer measure differently from another."""
    try:
        device = {str(k): str(v) for k, v in mx.device_info().items()}
    except Exception:  # older MLX, or no device information on this backend
        device = {}
    return {
        "system": platform.system(),
        "arch": platform.machine(),
        "device": str(mx.default_device()),
        "device_info": device,
        "ram_bytes": total_ram_bytes(),
    }


def model_files(path: Path) -> list[list[Any]]:
    """Name, size and modification time of each file in the model folder (a replaced
    or re-downloaded weight file changes one of them; nothing is read or hashed)."""
    out = []
    for file in sorted(path.iterdir()):
        if file.is_file() and not file.name.startswith("."):
            stat = file.stat()
            out.append([file.name, stat.st_size, stat.st_mtime_ns])
    return out


# Entries kept per model folder (the newest): a few settings a user switches between.
ENTRIES_PER_MODEL = 4


def _model_digest(model_path: Path) -> str:
    return hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:24]


def entry_path(folder: Path, model_path: Path, key: dict[str, Any]) -> Path:
    """The file of one model folder's entry for ``key`` in a folder of keyed entries:
    ``<digest of the model's real path>-<digest of the key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"{_model_digest(model_path)}-{digest}.json"


def model_entries(folder: Path, model_path: Path) -> list[Path]:
    """A model folder's entries in ``folder``, newest first (an older omlx's single
    ``<digest>.json`` among them)."""
    dated = []
    for path in folder.glob(_model_digest(model_path) + "*.json"):
        try:
            dated.append((path.stat().st_mtime_ns, path))
        except OSError:  # removed meanwhile
            continue
    return [path for _, path in sorted(dated, reverse=True)]


def mark_used(path: Path) -> None:
    """A reused entry counts as new: the entries a user switches between stay."""
    with contextlib.suppress(OSError):  # a read-only folder: the entry may go sooner
        path.touch()


def keep_newest_entries(folder: Path, model_path: Path) -> None:
    """Remove a model folder's entries beyond the newest ``ENTRIES_PER_MODEL``."""
    for path in model_entries(folder, model_path)[ENTRIES_PER_MODEL:]:
        try:
            path.unlink()
        except OSError as exc:  # another start removed it, or a read-only folder
            log.debug("could not remove the old entry %s: %s", path, exc)


@dataclass(frozen=True)
class ProfileInputs:
    """The auto-profile's parameters besides the model, its dims and the limits."""

    chunk_tokens: int
    batch_size: int
    vocab_size: int
    explicit_tokens: int | None
    max_tokens_in_flight: int
    # The longest prompt: bounds the long-context point.
    context_window: int


def profile_model(
    cache: ProfileCache,
    info: ModelInfo,
    model: LanguageModel,
    dims: ModelDims,
    probe: MemoryProbe,
    limits: Limits,
    inputs: ProfileInputs,
    vision: VisionEncoder | None = None,
) -> tuple[KVProfile, bool]:
    """``auto_profile`` of a freshly loaded model, or the stored result when nothing it
    depends on changed (a VLM's processor files are among the model's files).
    Returns (profile, whether it was reused)."""

    def measure() -> KVProfile:
        # A VLM's image pass first, on the freshly loaded model (profile.measure_image).
        image = measure_image(vision, probe, limits) if vision is not None else (0, 0)
        profile = auto_profile(
            model,
            dims,
            probe,
            limits,
            chunk_tokens=inputs.chunk_tokens,
            batch_size=inputs.batch_size,
            vocab_size=inputs.vocab_size,
            explicit_tokens=inputs.explicit_tokens,
            max_tokens_in_flight=inputs.max_tokens_in_flight,
            context_window=inputs.context_window,
        )
        return dataclasses.replace(
            profile, image_peak_bytes=image[0], image_estimate_bytes=image[1]
        )

    return cache.measure_or_reuse(profile_key(info, dims, limits, inputs), info.path, measure)


def profile_key(
    info: ModelInfo, dims: ModelDims, limits: Limits, inputs: ProfileInputs
) -> dict[str, Any]:
    """Everything the profile of ``info`` depends on, as plain JSON values."""
    return {
        "format": FORMAT,
        "omlx": __version__,
        "mlx": getattr(mx, "__version__", "unknown"),
        "machine": machine_signature(),
        "model": {"path": str(info.path.resolve()), "kind": info.kind},
        "files": model_files(info.path),
        "dims": dataclasses.asdict(dims),
        "limits": dataclasses.asdict(limits),
        "inputs": dataclasses.asdict(inputs),
    }


class ProfileCache:
    """Profiles by model folder, in ``folder`` (created private on first write)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.num_reused = 0
        self.num_measured = 0
        self.num_ignored = 0

    def path_for(self, model_path: Path, key: dict[str, Any]) -> Path:
        return entry_path(self.folder, model_path, key)

    def measure_or_reuse(
        self, key: dict[str, Any], model_path: Path, measure: Callable[[], KVProfile]
    ) -> tuple[KVProfile, bool]:
        """The stored profile when its key is ``key``, else ``measure()`` (stored
        afterwards). Returns (profile, whether it was reused)."""
        path = self.path_for(model_path, key)
        stored = self._read(path, key, model_path.name)
        if stored is not None:
            self.num_reused += 1
            mark_used(path)
            log.info(
                "memprofile: reused the auto-profile of %s from %s (max_kv_tokens %d, "
                "measured in %.1f s at an earlier start)",
                model_path.name,
                path,
                stored.max_kv_tokens,
                stored.seconds,
            )
            return stored, True
        if not path.exists():
            log.info("memprofile: measuring %s: %s", model_path.name, self._news(model_path, key))
        profile = measure()
        self.num_measured += 1
        self._write(path, key, profile)
        keep_newest_entries(self.folder, model_path)
        return profile, False

    def _news(self, model_path: Path, key: dict[str, Any]) -> str:
        """What differs from the model's newest entry, for the log (the user sees why
        a start is slower)."""
        for path in model_entries(self.folder, model_path):
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            return _what_changed(entry.get("key") if isinstance(entry, dict) else None, key)
        return "no earlier profile"

    def _read(self, path: Path, key: dict[str, Any], model: str) -> KVProfile | None:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._ignore(path, model, f"unreadable ({exc})")
            return None
        try:
            entry = json.loads(text)
        except ValueError:
            self._ignore(path, model, "not valid JSON")
            return None
        if not isinstance(entry, dict) or entry.get("key") != key:
            self._ignore(path, model, "it names other inputs than its file's")
            return None
        profile = _profile_from(entry.get("profile"))
        if profile is None:
            self._ignore(path, model, "its profile is malformed")
            return None
        return profile

    def _ignore(self, path: Path, model: str, why: str) -> None:
        self.num_ignored += 1
        log.warning(
            "memprofile: ignoring the stored profile of %s (%s): %s; measuring again",
            model,
            path,
            why,
        )

    def _write(self, path: Path, key: dict[str, Any], profile: KVProfile) -> None:
        entry = {"key": key, "profile": dataclasses.asdict(profile)}
        try:
            write_json_atomic(path, entry)
        except OSError as exc:  # a read-only data folder costs the next start a profile
            log.warning("memprofile: cannot store the auto-profile in %s: %s", path, exc)


def _what_changed(old: Any, new: dict[str, Any]) -> str:
    """Which part of the key differs, for the log (the user sees why a start is slower)."""
    if not isinstance(old, dict):
        return "no earlier profile of this format"
    parts = [name for name in new if old.get(name) != new[name]]
    return "changed " + ", ".join(parts) if parts else "the stored entry differs"


def _profile_from(data: Any) -> KVProfile | None:
    """A KVProfile from stored JSON, or None unless every field is present and sane."""
    fields = {f.name for f in dataclasses.fields(KVProfile)}
    if not isinstance(data, dict) or set(data) != fields:
        return None
    values: dict[str, Any] = {}
    for name, value in data.items():
        if name == "source":
            if value not in _SOURCES:
                return None
        elif name == "seconds":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                return None
            value = float(value)
        elif type(value) is not int or value < 0:
            return None
        values[name] = value
    return KVProfile(**values) if values["max_kv_tokens"] >= 1 else None
