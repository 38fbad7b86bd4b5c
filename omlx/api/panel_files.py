"""The admin panel's static files (web/) at /admin: served by ``omlx serve`` and by
``omlx router`` (whose page shows its backends). No MLX import: the router has none."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles

from omlx.errors import NotFoundError

log = logging.getLogger(__name__)

# Sub-folders of web/ served as files. Mounting these (not all of /admin) keeps
# every /admin/api route reachable whatever order routers are included in.
ASSET_DIRS = ("css", "js", "vendor", "img")


def resolve_web_dir(override: Path | None = None) -> Path:
    """The folder holding the admin panel: ``override`` (a frozen app's), else ``<repo>/web``."""
    if override is not None:
        return Path(override).expanduser().resolve()
    return Path(__file__).resolve().parents[2] / "web"


class _RevalidatedFiles(StaticFiles):
    """Static files the browser re-checks (ETag) on every load: no build step
    means no hashed names, so an upgrade must not be hidden behind a cache."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def serve_panel_files(app: FastAPI, folder: Path) -> None:
    """web/ at /admin (index at /admin/); no key needed (the login page is one of them)."""
    index = folder / "index.html"
    if not index.is_file():
        log.warning("admin panel not found at %s; /admin will answer 404", folder)

    @app.get("/admin", include_in_schema=False)
    async def admin_redirect() -> RedirectResponse:
        return RedirectResponse("/admin/", status_code=307)

    @app.get("/admin/", include_in_schema=False)
    async def admin_index() -> FileResponse:
        if not index.is_file():
            raise NotFoundError(f"the admin panel is not installed (no {index})")
        return FileResponse(index, headers={"Cache-Control": "no-cache"})

    for sub in ASSET_DIRS:
        if (folder / sub).is_dir():
            app.mount(f"/admin/{sub}", _RevalidatedFiles(directory=folder / sub), f"admin-{sub}")
