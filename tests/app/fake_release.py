"""A release to update to, made by the build's own disk-image code, served over real HTTP.

The app is `skeleton_app`'s (real Info.plist and resources) with a launcher script that
records it was started; the image is the xorriso ISO/HFS+ hybrid of `build.py dmg-layout`
(hdiutil cannot run here).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packaging"))

from omlx_build import dmg  # noqa: E402
from omlx_build.project import load_config  # noqa: E402

LAUNCHER = """#!/bin/sh
echo "relaunched {version}" > "{marker}"
"""


class FeedServer:
    """A real HTTP server over a folder; it remembers every path asked for."""

    def __init__(self, root: Path, host: str = "127.0.0.1"):
        self.requests: list[str] = []
        requests = self.requests

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                requests.append(self.path)

        self.httpd = ThreadingHTTPServer((host, 0), partial(Handler, directory=str(root)))
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, name: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/{name}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def make_app(parent: Path, version: str, marker: Path, launcher: str = LAUNCHER) -> Path:
    """omlx.app as the build lays it out, at ``version``, whose launcher writes ``marker``."""
    config = dataclasses.replace(load_config(), version=version)
    parent.mkdir(parents=True, exist_ok=True)
    app = dmg.skeleton_app(config, parent)
    script = app / "Contents" / "MacOS" / config.name
    script.write_text(launcher.format(version=version, marker=marker))
    return app


def make_dmg(
    tmp_path: Path, version: str, marker: Path, out: Path, launcher: str = LAUNCHER
) -> Path:
    build = tmp_path / f"build-{version}-{out.stem}"
    app = make_app(build / "app", version, marker, launcher)
    dmg.xorriso_image(dmg.stage(app, build / "stage"), out, f"omlx {version}")
    return out


def publish(root: Path, image: Path, version: str, sha256: str | None) -> None:
    feed = {"version": version, "url": image.name, "notes": "Faster."}
    if sha256 is not None:
        feed["sha256"] = sha256
    (root / "omlx-update.json").write_text(json.dumps(feed))


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_digest(path: Path) -> str:
    """Every file's path, mode, bytes and link target under ``path``."""
    digest = hashlib.sha256()
    for item in sorted(path.rglob("*")):
        digest.update(f"{item.relative_to(path)} {item.lstat().st_mode:o}".encode())
        if item.is_symlink():
            digest.update(os.readlink(item).encode())
        elif item.is_file():
            digest.update(item.read_bytes())
    return digest.hexdigest()
