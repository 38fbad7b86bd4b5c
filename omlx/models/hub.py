"""The Hugging Face Hub, read through ``huggingface_hub``: what a repo holds, search.

Before a byte of a model is downloaded, ``inspect_repo`` reads the repo's file list and
sizes and decides what it is: an MLX model omlx can load (a ``config.json`` whose
``model_type`` mlx-lm supports, plus safetensors weights), a GGUF-only repo (its GGUF
files are offered for import instead), or not a model (400). Hub failures become omlx
errors that name what to change: a token setting, a mirror, the repo id.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omlx.errors import InvalidRequestError, NotFoundError, OmlxError
from omlx.settings import Settings

log = logging.getLogger(__name__)

# Files a model download skips: other frameworks' weights and GGUF copies some MLX
# repos carry next to the safetensors (omlx loads neither from a model folder).
IGNORE_PATTERNS = [
    "*.bin",
    "*.pth",
    "*.pt",
    "*.ckpt",
    "*.gguf",
    "*.onnx",
    "*.onnx_data",
    "*.h5",
    "*.msgpack",
    "*.ot",
    "original/*",
    ".gitattributes",
]
SEARCH_CONFIG_WORKERS = 8
HUB_CACHE_DIR = "hub-cache"
REACHABLE_TIMEOUT_S = 5.0
_TOKEN_SETTING = "models.hf_token (or the HF_TOKEN environment variable)"
_UNREACHABLE = "Hub unreachable: offline? set models.hf_endpoint (a mirror)"
# Bytes per parameter of the dtypes the Hub's safetensors summary counts.
_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# llama.cpp's gguf-split parts: "model-00001-of-00003.gguf".
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_BITS = re.compile(r"(?<![0-9])([2-8])-?bits?(?![a-z])", re.IGNORECASE)


class HubUnreachableError(OmlxError):
    """The Hub (or the configured mirror) did not answer, or answered with a 5xx."""

    http_status = 502
    error_type = "server_error"
    code = "hub_unreachable"


class HubAccessError(OmlxError):
    """A gated or private repo and no token (401) or a token without access (403)."""

    error_type = "permission_error"
    code = "hub_token_required"

    def __init__(self, message: str, *, http_status: int):
        super().__init__(message, param="repo_id")
        self.http_status = http_status


@dataclass(frozen=True, slots=True)
class HubAccess:
    """Where the Hub is and which token to send (None: huggingface_hub's own lookup,
    which reads HF_TOKEN and the token `hf auth login` saved)."""

    endpoint: str
    token: str | None = field(default=None, repr=False)
    # huggingface_hub's cache (configs read while inspecting, refs): omlx's own, so
    # nothing is written to ~/.cache/huggingface. None: huggingface_hub's default.
    cache_dir: Path | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> HubAccess:
        from huggingface_hub import constants

        # constants.ENDPOINT is HF_ENDPOINT (read by huggingface_hub), else huggingface.co.
        endpoint = settings.models.hf_endpoint or constants.ENDPOINT
        return cls(
            endpoint=endpoint.rstrip("/"),
            token=settings.models.hf_token,
            cache_dir=settings.base_path / HUB_CACHE_DIR,
        )

    def api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token, library_name="omlx")

    def has_token(self) -> bool:
        from huggingface_hub import get_token

        return bool(self.token or get_token())


@dataclass(frozen=True, slots=True)
class RepoFileEntry:
    name: str
    size: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size}


@dataclass(frozen=True, slots=True)
class RepoInspection:
    repo_id: str
    revision: str
    commit: str
    kind: str  # "mlx" | "gguf"
    files: list[RepoFileEntry]  # what a download fetches (mlx) or the repo's files (gguf)
    gguf_files: list[RepoFileEntry]
    config: dict[str, Any] | None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weights_bytes(self) -> int:
        return sum(f.size for f in self.files if f.name.endswith(".safetensors"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "kind": self.kind,
            "files": [f.as_dict() for f in self.files],
            "total_bytes": self.total_bytes,
            "gguf_files": [f.as_dict() for f in self.gguf_files],
        }


def check_repo_id(repo_id: object) -> str:
    """``owner/name`` as the Hub spells repo ids; 400 naming the field otherwise."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

    if not isinstance(repo_id, str) or not repo_id.strip():
        raise InvalidRequestError(
            "'repo_id' must be a Hub repo id such as 'mlx-community/Qwen3-0.6B-4bit'",
            param="repo_id",
        )
    try:
        validate_repo_id(repo_id.strip())
    except HFValidationError as exc:
        raise InvalidRequestError(f"'repo_id' {repo_id!r} is not a Hub repo id: {exc}") from None
    return repo_id.strip()


@contextmanager
def hub_errors(access: HubAccess, repo_id: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub / transport failures into omlx errors that say what to do."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except GatedRepoError:
        raise _gated(access, repo_id or "the repo") from None
    except RevisionNotFoundError:
        raise NotFoundError(
            f"'{repo_id}' has no such revision on {access.endpoint}: give a branch, tag or "
            "commit that exists (default: main)",
            param="revision",
            code="revision_not_found",
        ) from None
    except RepositoryNotFoundError as exc:
        raise _not_found(access, repo_id or "the repo", exc.response.status_code) from None
    except RemoteEntryNotFoundError as exc:
        raise InvalidRequestError(
            f"'{repo_id}' lacks a file a model needs ({exc.response.url.path.rsplit('/', 1)[-1]})",
            param="repo_id",
            code="not_a_model",
        ) from None
    except HfHubHTTPError as exc:
        raise _http_error(access, repo_id, exc.response.status_code, str(exc)) from None
    # huggingface_hub answers "not in the local cache" when a file download cannot connect.
    except (httpx2.TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        raise HubUnreachableError(f"{_UNREACHABLE} ({access.endpoint}: {exc})") from None


def _gated(access: HubAccess, repo_id: str) -> HubAccessError:
    if access.has_token():
        return HubAccessError(
            f"'{repo_id}' is gated and the token in {_TOKEN_SETTING} has no access: accept "
            "the repo's terms on the Hub with that account, or set a token that has",
            http_status=403,
        )
    return HubAccessError(
        f"'{repo_id}' is gated: accept its terms on the Hub, then set {_TOKEN_SETTING} "
        "to a read token of that account",
        http_status=401,
    )


def _not_found(access: HubAccess, repo_id: str, status: int) -> OmlxError:
    if status == 401:  # what the Hub answers for a private repo without a token
        return HubAccessError(
            f"'{repo_id}' was not found on {access.endpoint} or is private: check the id, or "
            f"set {_TOKEN_SETTING} to a token that can read it",
            http_status=401,
        )
    return NotFoundError(
        f"no model repo '{repo_id}' on {access.endpoint}: check the id (owner/name, e.g. "
        "'mlx-community/Qwen3-0.6B-4bit')",
        param="repo_id",
        code="repo_not_found",
    )


def _http_error(access: HubAccess, repo_id: str | None, status: int, detail: str) -> OmlxError:
    if status == 403:
        return HubAccessError(
            f"the Hub refused access to '{repo_id}' (403): set {_TOKEN_SETTING} to a token "
            "with read access",
            http_status=403,
        )
    first_line = detail.strip().splitlines()[0] if detail.strip() else f"HTTP {status}"
    return HubUnreachableError(f"{_UNREACHABLE} ({access.endpoint} answered: {first_line})")


# -- inspection --------------------------------------------------------------


def inspect_repo(access: HubAccess, repo_id: str, revision: str | None) -> RepoInspection:
    """The repo's files, sizes and kind; raises NotFound / HubAccess / 400 not a model."""
    from huggingface_hub.utils import filter_repo_objects  # type: ignore[attr-defined]

    repo_id = check_repo_id(repo_id)
    revision = revision or "main"
    with hub_errors(access, repo_id):
        info = access.api().model_info(repo_id, revision=revision, files_metadata=True)
    siblings = [RepoFileEntry(s.rfilename, int(s.size or 0)) for s in info.siblings or []]
    names = {f.name for f in siblings}
    gguf = [f for f in siblings if f.name.lower().endswith(".gguf")]
    has_weights = any(n.endswith(".safetensors") and "/" not in n for n in names)
    if "config.json" not in names or not has_weights:
        if gguf:
            return RepoInspection(repo_id, revision, str(info.sha), "gguf", gguf, gguf, None)
        raise _not_a_model(repo_id, names)
    config = read_config(access, repo_id, str(info.sha))
    check_supported(repo_id, config)
    wanted = set(filter_repo_objects(sorted(names), ignore_patterns=IGNORE_PATTERNS))
    files = [f for f in siblings if f.name in wanted]
    return RepoInspection(repo_id, revision, str(info.sha), "mlx", files, gguf, config)


def inspect_gguf_file(
    access: HubAccess, repo_id: str, revision: str | None, gguf_file: str
) -> RepoInspection:
    """One GGUF file of a repo (any repo that has it), as the only file to download;
    400 naming the repo's GGUF files when it lacks ``gguf_file``."""
    repo_id = check_repo_id(repo_id)
    revision = revision or "main"
    with hub_errors(access, repo_id):
        info = access.api().model_info(repo_id, revision=revision, files_metadata=True)
    siblings = [RepoFileEntry(s.rfilename, int(s.size or 0)) for s in info.siblings or []]
    gguf = [f for f in siblings if f.name.lower().endswith(".gguf")]
    wanted = next((f for f in gguf if f.name == gguf_file), None)
    if wanted is None:
        listed = ", ".join(f.name for f in gguf[:20]) or "none"
        raise InvalidRequestError(
            f"'{repo_id}' has no GGUF file '{gguf_file}'; its GGUF files: {listed}",
            param="gguf_file",
            code="gguf_file_not_found",
        )
    if _SPLIT_GGUF.search(wanted.name):
        raise InvalidRequestError(
            f"'{gguf_file}' is one part of a split GGUF, which omlx cannot import: pick a "
            "single-file quantization",
            param="gguf_file",
            code="split_gguf",
        )
    return RepoInspection(repo_id, revision, str(info.sha), "gguf", [wanted], gguf, None)


def _not_a_model(repo_id: str, names: set[str]) -> InvalidRequestError:
    if "config.json" not in names:
        why = "it has no config.json"
    else:
        other = sorted(n for n in names if n.endswith((".bin", ".pth", ".pt")))[:3]
        found = f" (it has {', '.join(other)})" if other else ""
        why = (
            f"it has no .safetensors weights{found}; pick an MLX conversion such as an "
            "mlx-community repo, or convert it with mlx_lm.convert"
        )
    return InvalidRequestError(
        f"'{repo_id}' is not an MLX model omlx can load: {why}", param="repo_id", code="not_a_model"
    )


def read_config(access: HubAccess, repo_id: str, commit: str) -> dict[str, Any]:
    """The repo's config.json (a few KB, kept in huggingface_hub's cache)."""
    from huggingface_hub import hf_hub_download

    with hub_errors(access, repo_id):
        path = hf_hub_download(
            repo_id,
            "config.json",
            revision=commit,
            endpoint=access.endpoint,
            token=access.token,
            cache_dir=access.cache_dir,
        )
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(
            f"'{repo_id}' has an unreadable config.json ({exc})",
            param="repo_id",
            code="not_a_model",
        ) from None
    if not isinstance(config, dict):
        raise InvalidRequestError(
            f"'{repo_id}' has a config.json that is not a JSON object",
            param="repo_id",
            code="not_a_model",
        )
    return config


def mlx_lm_supports(model_type: str) -> bool:
    """Whether mlx-lm has an implementation for ``model_type`` (after its remapping)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    models_dir = Path(next(iter(spec.submodule_search_locations))) / "models"
    if (models_dir / f"{model_type}.py").is_file():
        return True
    from mlx_lm.utils import MODEL_REMAPPING  # imports MLX: only for the remapped names

    remapped = MODEL_REMAPPING.get(model_type)
    return remapped is not None and (models_dir / f"{remapped}.py").is_file()


def check_supported(repo_id: str, config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InvalidRequestError(
            f"'{repo_id}' is not a model omlx can load: its config.json has no model_type",
            param="repo_id",
            code="not_a_model",
        )
    if not re.fullmatch(r"[A-Za-z0-9_]+", model_type) or not mlx_lm_supports(model_type):
        raise InvalidRequestError(
            f"'{repo_id}' is a '{model_type}' model, which mlx-lm (and so omlx) cannot load",
            param="repo_id",
            code="not_a_model",
        )


def quantization_label(config: dict[str, Any] | None, names: list[str]) -> str | None:
    """``"4bit"`` from an MLX config's quantization, else from the repo's name or tags."""
    quant = (config or {}).get("quantization") or {}
    if isinstance(quant, dict) and isinstance(quant.get("bits"), int):
        return f"{quant['bits']}bit"
    for name in names:
        match = _BITS.search(name)
        if match:
            return f"{match.group(1)}bit"
    return None


# -- search ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SearchHit:
    repo_id: str
    downloads: int
    likes: int
    size_bytes: int | None
    quantization: str | None
    config: dict[str, Any] | None


def search_models(access: HubAccess, query: str, limit: int) -> list[SearchHit]:
    """MLX models matching ``query``, most downloaded first, each with its config
    (fetched in parallel; None when it cannot be read)."""
    from huggingface_hub import get_session

    with hub_errors(access):
        # list_models retries a refused connection for ~20 s; an offline Hub should
        # answer the search box at once.
        get_session().head(access.endpoint, timeout=REACHABLE_TIMEOUT_S)
        found = list(
            access.api().list_models(
                search=query or None,
                filter="mlx",
                sort="downloads",
                limit=limit,
                expand=["downloads", "likes", "safetensors", "tags"],
            )
        )
    with ThreadPoolExecutor(max_workers=SEARCH_CONFIG_WORKERS) as pool:
        configs = list(pool.map(lambda m: _config_or_none(access, m.id), found))
    return [
        SearchHit(
            repo_id=m.id,
            downloads=int(m.downloads or 0),
            likes=int(m.likes or 0),
            size_bytes=_safetensors_bytes(m.safetensors),
            quantization=quantization_label(config, [m.id, *(m.tags or [])]),
            config=config,
        )
        for m, config in zip(found, configs, strict=True)
    ]


def _config_or_none(access: HubAccess, repo_id: str) -> dict[str, Any] | None:
    try:
        return read_config(access, repo_id, "main")
    except OmlxError as exc:
        log.debug("no config for %s: %s", repo_id, exc.message)
        return None


def _safetensors_bytes(summary: Any) -> int | None:
    """Weight bytes from the Hub's per-dtype parameter counts (packed MLX weights count
    as U32 parameters, so this is the files' size less their headers)."""
    params = getattr(summary, "parameters", None)
    if not params:
        return None
    return sum(int(n) * _DTYPE_BYTES.get(str(dtype).upper(), 2) for dtype, n in params.items())
