"""The Python code a model folder asks its loaders to import, and the refusal when the
model's settings do not allow it (``trust_remote_code``). Pure: reads JSON files only.

transformers imports a folder's own module wherever an ``auto_map`` names one for a
class it builds, and mlx-lm where config.json names a ``model_file``. With
``trust_remote_code=False`` transformers raises only when it has no class of its own
for the model; otherwise it silently takes that class instead (another tokenizer,
other tokens). So omlx reads the folder first and refuses before any library loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx.errors import RemoteCodeNotAllowedError

# The files whose auto_map the tokenizer and processor loaders read.
_AUTO_MAP_FILES = (
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "config.json",
)
# The classes omlx's loaders build through transformers. config.json's AutoConfig and
# AutoModel* entries are left out: mlx-lm and mlx-vlm bring their own model classes,
# and transformers reads a known model type's config without the folder's code (a
# DeepSeek-V3 checkpoint names configuration_deepseek.py and serves without it).
_BUILT_CLASSES = (
    "AutoTokenizer",
    "AutoProcessor",
    "AutoImageProcessor",
    "AutoVideoProcessor",
    "AutoFeatureExtractor",
)
SETTING_HINT = "set trust_remote_code: true in its settings"


@dataclass(frozen=True, slots=True)
class FolderCode:
    """Modules a folder's file names for a loader to import."""

    modules: tuple[str, ...]  # "tokenization_foo.py" (or "repo: module.py" on the Hub)
    named_by: str  # "auto_map in tokenizer_config.json"

    def describe(self) -> str:
        return f"{', '.join(self.modules)}, named by {self.named_by}"


def folder_code(folder: Path) -> list[FolderCode]:
    """What code loading ``folder`` would import (empty: none)."""
    found = []
    for filename in _AUTO_MAP_FILES:
        data = _read_json(folder / filename)
        modules = _auto_map_modules(data.get("auto_map"))
        if modules:
            found.append(FolderCode(modules, f"auto_map in {filename}"))
    model_file = _read_json(folder / "config.json").get("model_file")
    if isinstance(model_file, str):
        found.append(FolderCode((model_file,), "model_file in config.json"))
    return found


def refusal(
    name: str, code: list[FolderCode], hint: str = SETTING_HINT
) -> RemoteCodeNotAllowedError:
    shipped = "; ".join(c.describe() for c in code)
    return RemoteCodeNotAllowedError(
        f"model '{name}' ships its own Python code ({shipped}); omlx runs a model "
        f"folder's code only when you allow it: {hint}",
        param="trust_remote_code",
    )


def require_allowed(name: str, folder: Path, allowed: bool, hint: str = SETTING_HINT) -> None:
    """Raise RemoteCodeNotAllowedError when ``folder`` names code and it is not allowed."""
    if allowed:
        return
    code = folder_code(folder)
    if code:
        raise refusal(name, code, hint)


def library_refusal(name: str, exc: Exception) -> RemoteCodeNotAllowedError | None:
    """transformers' or mlx-lm's own refusal (a ValueError naming trust_remote_code) of
    code this module's reading missed, as omlx's error; None for another error."""
    if not isinstance(exc, ValueError) or "trust_remote_code" not in str(exc):
        return None
    first = str(exc).strip().splitlines()[0]
    return RemoteCodeNotAllowedError(
        f"model '{name}' needs its own Python code to load ({first}); omlx runs a model "
        f"folder's code only when you allow it: {SETTING_HINT}",
        param="trust_remote_code",
    )


def _auto_map_modules(auto_map: Any) -> tuple[str, ...]:
    if isinstance(auto_map, list):  # the legacy tokenizer form: [slow, fast]
        refs = list(auto_map)
    elif isinstance(auto_map, dict):
        refs = []
        for key in _BUILT_CLASSES:
            value = auto_map.get(key)
            refs.extend(value if isinstance(value, list) else [value])
    else:
        return ()
    return tuple(dict.fromkeys(_module_file(r) for r in refs if isinstance(r, str) and r))


def _module_file(class_ref: str) -> str:
    """ "tokenization_foo.FooTokenizer" -> "tokenization_foo.py"; a Hub reference
    ("org/repo--tokenization_foo.FooTokenizer") keeps its repository."""
    repo, _, ref = class_ref.rpartition("--")
    module = ref.rsplit(".", 1)[0] + ".py"
    return f"{repo}: {module}" if repo else module


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
