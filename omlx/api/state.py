"""What the routes share: settings and the engine pool."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from omlx.api.render_pool import RenderPool
from omlx.engine.pool import EnginePool
from omlx.grammar.compile_pool import CompilePool
from omlx.models.download_tasks import DownloadManager
from omlx.quant.tasks import TaskManager
from omlx.settings import Settings


@dataclass(slots=True)
class ServerState:
    settings: Settings
    pool: EnginePool
    started_s: float = field(default_factory=time.time)
    # The app's threads for chat templates and tokenizing, and for grammar compiles:
    # every model's requests share them.
    render_pool: RenderPool = field(default_factory=RenderPool)
    compile_pool: CompilePool = field(default_factory=CompilePool)
    # oQ tasks write into the first model dir, where discovery finds the result.
    quant_tasks: TaskManager = field(init=False)
    # Hub downloads, likewise into the first model dir (started by the app's lifespan).
    downloads: DownloadManager = field(init=False)

    def __post_init__(self) -> None:
        self.quant_tasks = TaskManager(self.settings.model_dirs[0], tracker=self.pool.probe)
        self.downloads = DownloadManager(self.settings, pool=self.pool)


def state_of(request: Request) -> ServerState:
    """The ServerState of the app serving ``request``."""
    state: ServerState = request.app.state.omlx
    return state
