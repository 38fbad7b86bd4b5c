"""Run the app with uvicorn: blocking for the CLI, or in a thread for tests."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from omlx.api.app import create_app
from omlx.engine.pool import EnginePool
from omlx.engine.worker import MLXWorker
from omlx.settings import Settings


class Server:
    """The MLX worker, the engine pool and uvicorn, started and stopped together."""

    def __init__(self, settings: Settings, cluster: Any = None):
        self.settings = settings
        self.worker = MLXWorker()
        # cluster: omlx.distributed.cluster.Cluster on rank 0 of `serve --distributed`.
        self.pool = EnginePool(settings, self.worker, cluster=cluster)
        self.app = create_app(settings, self.pool)
        config = uvicorn.Config(
            self.app,
            host=settings.server.host,
            port=settings.server.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
            # Longer than clients keep idle connections (httpx, so the openai and
            # anthropic SDKs: 5 s); at uvicorn's own 5 s the server may close one just
            # as the client reuses it, and that request fails with a reset.
            timeout_keep_alive=30,
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.server.host}:{self.settings.server.port}"

    def run(self) -> None:
        """Blocking; returns after SIGINT/SIGTERM."""
        self.worker.start()
        try:
            self._uvicorn.run()
        finally:
            self.worker.stop()

    def start_in_thread(self, timeout_s: float = 30.0) -> None:
        """Start uvicorn in a thread; the MLX worker too, unless the caller already
        started it (a test that queues work on it before the models load)."""
        if not self.worker.is_alive:
            self.worker.start()
        # uvicorn only installs signal handlers on the main thread.
        self._thread = threading.Thread(target=self._uvicorn.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 15.0) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.worker.stop()
