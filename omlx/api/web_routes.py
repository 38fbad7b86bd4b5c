"""The admin panel: web/ served at /admin, plus the admin API it needs beyond
admin_routes: the server log tail, GGUF import and the built-in model install.

The static files need no key (the login page is one of them); the API routes
here require the key or a login session like the rest of /admin/api.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from pydantic import ValidationError

from omlx.api.auth import require_admin
from omlx.api.panel_files import resolve_web_dir, serve_panel_files
from omlx.api.state import state_of
from omlx.embeddings.builtin import BUILTIN_EMBEDDING_NAME, install_default_embedding_model
from omlx.engine.pool import EnginePool
from omlx.errors import ImportFailedError, InvalidRequestError, NotFoundError, SettingsError
from omlx.models.gguf_pull import import_job
from omlx.settings import MemorySettings, Settings

log = logging.getLogger(__name__)

LOG_FILE = "server.log"
MAX_LOG_LINES = 5000
# Bytes one log request reads at most: a tail widens its window up to this.
MAX_LOG_READ_BYTES = 8 << 20
LOG_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
# cli.LOG_FORMAT: "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LOG_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+?): ?(.*)$"
)
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

router = APIRouter(prefix="/admin/api", dependencies=[Depends(require_admin)])


# -- static files ------------------------------------------------------------


def install_web(app: FastAPI, settings: Settings) -> None:
    """Serve web/ at /admin (index at /admin/) and add the panel's admin API."""
    app.state.web_import_lock = asyncio.Lock()
    app.include_router(router)
    serve_panel_files(app, resolve_web_dir(settings.server.web_dir))


# -- log tail ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogLine:
    text: str
    # None for a continuation line (a traceback) whose record started earlier.
    level: str | None
    time: str | None
    logger: str | None
    message: str


def parse_log_lines(text: str) -> list[LogLine]:
    """Lines in the server's log format; continuation lines inherit the record's level."""
    out, level = [], None
    for raw in text.splitlines():
        match = _LOG_LINE.match(raw)
        if match:
            level = match.group(2).lower()
            out.append(LogLine(raw, level, match.group(1), match.group(3), match.group(4)))
        else:
            out.append(LogLine(raw, level, None, None, raw))
    return out


def _keep(line: LogLine, min_level: int) -> bool:
    if min_level <= LOG_LEVELS["debug"]:
        return True
    return line.level is not None and LOG_LEVELS[line.level] >= min_level


def _complete_lines(data: bytes, start: int, *, partial_head: bool) -> tuple[str, int]:
    """Whole lines of ``data`` (read at offset ``start``) and the offset after the last."""
    head = data.find(b"\n") + 1 if partial_head else 0
    end = data.rfind(b"\n") + 1
    if end <= head:
        return "", start + head
    return data[head:end].decode("utf-8", errors="replace"), start + end


def _tail(path: Path, size: int, num_lines: int, min_level: int) -> tuple[list[LogLine], int]:
    """The last ``num_lines`` kept lines, widening the read window until enough are found."""
    window = 64 << 10
    with path.open("rb") as fh:
        while True:
            start = max(0, size - window)
            fh.seek(start)
            text, cursor = _complete_lines(fh.read(size - start), start, partial_head=start > 0)
            kept = [ln for ln in parse_log_lines(text) if _keep(ln, min_level)]
            if len(kept) >= num_lines or start == 0 or window >= MAX_LOG_READ_BYTES:
                return kept[-num_lines:], cursor
            window *= 4


def _follow(path: Path, after: int, num_lines: int, min_level: int) -> tuple[list[LogLine], int]:
    """Kept lines written since byte offset ``after`` (at most MAX_LOG_READ_BYTES)."""
    with path.open("rb") as fh:
        fh.seek(after)
        text, cursor = _complete_lines(fh.read(MAX_LOG_READ_BYTES), after, partial_head=False)
    kept = [ln for ln in parse_log_lines(text) if _keep(ln, min_level)]
    return kept[-num_lines:], cursor


def read_log(path: Path, num_lines: int, level: str, after: int | None) -> dict[str, Any]:
    """The log tail (``after`` None) or what follows the cursor ``after``.

    ``cursor`` is the byte offset to pass as ``after`` next time; ``reset`` says
    the file was rotated or truncated, so the lines start over from its top.
    """
    min_level = LOG_LEVELS[level]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return {"path": str(path), "exists": False, "lines": [], "cursor": 0, "reset": False}
    reset = after is not None and after > size
    if after is None:
        lines, cursor = _tail(path, size, num_lines, min_level)
    else:
        lines, cursor = _follow(path, 0 if reset else after, num_lines, min_level)
    return {
        "path": str(path),
        "exists": True,
        "size_bytes": size,
        "lines": [asdict(line) for line in lines],
        "cursor": cursor,
        "reset": reset,
    }


@router.get("/logs")
async def logs(
    request: Request,
    lines: int = Query(200, ge=1, le=MAX_LOG_LINES),
    level: str = Query("debug"),
    after: int | None = Query(None, ge=0),
) -> dict[str, Any]:
    """Tail of ``<base>/logs/server.log``; lines below ``level`` are left out."""
    if level.lower() not in LOG_LEVELS:
        raise InvalidRequestError(
            f"'level' must be one of {', '.join(LOG_LEVELS)}, not {level!r}", param="level"
        )
    path = state_of(request).settings.log_dir / LOG_FILE
    return await asyncio.to_thread(read_log, path, lines, level.lower(), after)


# -- model import --------------------------------------------------------------


def _run_in_process(pool: EnginePool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a fresh process: an import's MLX arrays and its peak memory
    (a whole model dequantized) stay out of the serving process, count in its
    memory readings, and are capped by what the memory ceiling leaves."""
    from omlx.models.import_child import import_memory_limit, run_in_child

    with pool.import_lock:  # a download's import may be running: share the headroom
        used = pool.probe.reading(fresh=True).resident_bytes
        limit = import_memory_limit(pool.limits.hard_bytes, used)
        return run_in_child(fn, *args, memory_limit_bytes=limit, tracker=pool.probe)


def _install_job(models_dir: str, force: bool) -> str:
    from omlx.models.builtin import install_default_model

    return str(install_default_model(Path(models_dir), force=force))


def check_model_name(name: object) -> str:
    """A new model folder name: one path component, no traversal, no hidden names."""
    if not isinstance(name, str) or not _MODEL_NAME.match(name):
        raise InvalidRequestError(
            f"'name' must be a folder name of letters, digits, '.', '_' or '-' starting "
            f"with a letter or digit (at most 128 characters, no '/' or '..'), not {name!r}",
            param="name",
        )
    return name


def _gguf_source(raw: object) -> Path:
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidRequestError("'path' must be the GGUF file's path", param="path")
    path = Path(raw.strip()).expanduser()
    if not path.is_absolute():
        raise InvalidRequestError(
            f"'path' must be an absolute path on the server, not {raw!r}", param="path"
        )
    if not path.exists():
        raise NotFoundError(f"no file at {path}", param="path")
    if not path.is_file():
        raise InvalidRequestError(f"{path} is not a file", param="path")
    return path


def _model_entry(request: Request, name: str) -> dict[str, Any] | None:
    return next((m for m in state_of(request).pool.status() if m["name"] == name), None)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json() if await request.body() else {}
    except ValueError:
        raise InvalidRequestError("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return body


@router.post("/models/import-gguf")
async def import_gguf_route(request: Request) -> dict[str, Any]:
    """Body ``{"path", "name"?, "dtype"?}``: convert a GGUF into the first model dir."""
    body = await _json_body(request)
    source = _gguf_source(body.get("path"))
    name = check_model_name(body.get("name") or source.stem)
    dtype = body.get("dtype")
    if dtype not in (None, "float32", "float16", "keep"):
        raise InvalidRequestError("'dtype' must be 'float32', 'float16' or 'keep'", param="dtype")
    target = state_of(request).settings.model_dirs[0] / name
    async with request.app.state.web_import_lock:
        if target.exists():
            raise ImportFailedError(
                f"a model named '{name}' already exists ({target}); choose another name",
                param="name",
            )
        log.info("importing %s as %s", source, target)
        pool = state_of(request).pool
        conversion = await asyncio.to_thread(
            _run_in_process, pool, import_job, str(source), str(target), dtype
        )
    # "conversion" says what became of each GGUF tensor type (kept, requantized, dequantized).
    entry = _model_entry(request, name)
    return {"name": name, "path": str(target), "model": entry, "conversion": conversion}


@router.post("/models/install-default")
async def install_default_route(request: Request) -> dict[str, Any]:
    """Body ``{"force"?: bool, "kind"?: "llm" | "embedding"}``: install the built-in chat
    model (SmolLM2) or embedding model (all-MiniLM-L6-v2); a no-op when present."""
    from omlx.models.builtin import BUILTIN_MODEL_NAME, is_complete_model_folder

    body = await _json_body(request)
    force, kind = body.get("force", False), body.get("kind", "llm")
    if not isinstance(force, bool):
        raise InvalidRequestError("'force' must be true or false", param="force")
    if kind not in ("llm", "embedding"):
        raise InvalidRequestError('\'kind\' must be "llm" or "embedding"', param="kind")
    models_dir = state_of(request).settings.model_dirs[0]
    name = BUILTIN_EMBEDDING_NAME if kind == "embedding" else BUILTIN_MODEL_NAME
    target = models_dir / name
    async with request.app.state.web_import_lock:
        present = not force and is_complete_model_folder(target)
        if not present and kind == "embedding":  # an unzip: no conversion, no child process
            log.info("installing the built-in embedding model into %s", models_dir)
            await asyncio.to_thread(install_default_embedding_model, models_dir, force=force)
        elif not present:
            log.info("installing the built-in model into %s", models_dir)
            pool = state_of(request).pool
            await asyncio.to_thread(_run_in_process, pool, _install_job, str(models_dir), force)
    return {
        "name": name,
        "path": str(target),
        "already_installed": present,
        "model": _model_entry(request, name),
    }


# -- memory preview --------------------------------------------------------------


@router.post("/memory/preview")
async def memory_preview(request: Request) -> dict[str, Any]:
    """The limits the given memory settings (merged over the running ones) would give."""
    from omlx.memory.guard import memory_limits
    from omlx.memory.probe import total_ram_bytes
    from omlx.sizes import parse_byte_size

    changes = await _json_body(request)
    merged = {**state_of(request).settings.memory.model_dump(), **changes}
    try:
        memory = MemorySettings.model_validate(merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise SettingsError(
            f"invalid setting 'memory.{field}': {first['msg']}", param=f"memory.{field}"
        ) from None
    ram = total_ram_bytes()
    limits = memory_limits(memory, ram, state_of(request).pool.memory.device_cap)
    # As EnginePool resolves it: "auto" is the hard limit, a size is capped by it.
    budget = limits.hard_bytes
    if memory.max_model_memory != "auto":
        budget = min(budget, parse_byte_size(memory.max_model_memory, total_bytes=budget))
    return {
        "total_ram_bytes": ram,
        "hard_bytes": limits.hard_bytes,
        "soft_bytes": limits.soft_bytes,
        "transient_margin_bytes": limits.transient_margin_bytes,
        "model_budget_bytes": budget,
    }
