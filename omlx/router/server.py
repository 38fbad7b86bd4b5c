"""Run the router app with uvicorn: blocking for the CLI, or in a thread for tests."""

from __future__ import annotations

import threading
import time

import uvicorn

from omlx.router.app import create_router_app
from omlx.router.config import RouterConfig


class RouterServer:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.app = create_router_app(config)
        uv_config = uvicorn.Config(
            self.app,
            host=config.host,
            port=config.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=30,  # longer than clients keep idle connections (see api/server.py)
        )
        self._uvicorn = uvicorn.Server(uv_config)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def run(self) -> None:
        """Blocking; returns after SIGINT/SIGTERM."""
        self._uvicorn.run()

    def start_in_thread(self, timeout_s: float = 30.0) -> None:
        self._thread = threading.Thread(target=self._uvicorn.run, name="router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("router did not start")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 15.0) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
