"""Building a model's engine on the MLX thread within the pool's memory limits in
force, swapping its draft model, and tearing engines down so their weights go
back to the system with the unload. MLX thread only."""

from __future__ import annotations

import gc
import logging
from typing import Any

from omlx.embeddings.engine import make_embedding_engine
from omlx.engine.admission import AdmissionSwitch
from omlx.engine.assembly import EngineParts, build_engine
from omlx.engine.catalog import ModelCatalog
from omlx.engine.drafts import attach_draft
from omlx.engine.model_engine import ModelEngine
from omlx.engine.pool_memory import PoolMemory
from omlx.engine.profile_cache import ProfileCache
from omlx.engine.residents import Engine
from omlx.engine.worker import MLXWorker
from omlx.memory import mlx_stats
from omlx.models.discovery import ModelInfo
from omlx.models.loader import LoadedModel, load_model
from omlx.settings import Settings

log = logging.getLogger(__name__)


class EngineBuilder:
    """``cluster``: omlx.distributed.cluster.Cluster when the model is split across
    ranks (it loads the weights on every rank), None when local."""

    def __init__(
        self,
        settings: Settings,
        catalog: ModelCatalog,
        memory: PoolMemory,
        worker: MLXWorker,
        *,
        profile_cache: ProfileCache,
        admission: AdmissionSwitch,
        cluster: Any = None,
    ) -> None:
        self._settings = settings
        self._catalog = catalog
        self._memory = memory
        self._worker = worker
        self._profile_cache = profile_cache
        self._admission = admission
        self._cluster = cluster
        # Per model built: whether its profile was measured or reused (for /health).
        self._load_facts: dict[str, dict[str, Any]] = {}

    def load_facts(self, name: str) -> dict[str, Any]:
        """How the model ``name`` became ready (its profile measured or reused)."""
        return dict(self._load_facts.get(name, {}))

    def build(self, info: ModelInfo) -> Engine:
        """Load ``info`` and make its engine, attached to the worker."""
        engine: Engine
        memory = self._memory
        with memory.live_baseline.tracking():
            if info.kind in ("embedding", "rerank"):
                sched = self._settings.scheduler
                capacity = sched.max_concurrent_requests + sched.max_queued_requests
                engine = make_embedding_engine(
                    info,
                    self._worker,
                    memory.limits,
                    memory.probe,
                    capacity,
                    memory.live_baseline.bytes_now,
                )
            else:
                cluster = self._cluster
                engine = self._make_engine(cluster.load(info) if cluster else load_model(info))
            self._worker.attach(engine)
        log.info(engine.guard.describe())
        return engine

    def _make_engine(self, loaded: LoadedModel) -> ModelEngine:
        # Built at each load: the limits object is swapped when the settings change.
        parts = EngineParts(
            self._settings,
            self._worker,
            self._memory.hot_cache,
            self._memory.limits,
            self._memory.probe,
            self._profile_cache,
            self._memory.live_baseline.bytes_now,
            self._admission,
            self._cluster,
        )
        catalog, name = self._catalog, loaded.info.name
        kv_quant = catalog.kv_quant(name)
        if kv_quant is not None and catalog.model_settings.get(name).speculative is not None:
            log.warning("speculative decoding off for %s: not with kv_bits (plain KV only)", name)
        engine, facts = build_engine(
            loaded,
            parts,
            window=catalog.context_window_for(loaded),
            explicit_kv_tokens=catalog.explicit_kv_tokens(name),
            kv_quant=kv_quant,
        )
        self._load_facts[name] = facts
        engine.num_draft = catalog.num_draft_tokens(name)
        draft = catalog.draft_info(name)
        if draft is not None:
            engine.draft = attach_draft(engine, draft)
        return engine

    def draft_changed(self, engine: ModelEngine) -> bool:
        """Whether ``engine``'s settings name another draft model than it drafts with."""
        draft = self._catalog.draft_info(engine.name)
        return bool((draft and draft.name) != (engine.draft and engine.draft.name))

    def redraft(self, engine: ModelEngine) -> None:
        """Load (or drop) a loaded model's draft model when its settings name another.
        Read here, in submission order, so the last settings change wins when several
        race."""
        if not self.draft_changed(engine):
            return
        with self._memory.live_baseline.tracking():
            engine.draft = attach_draft(engine, self._catalog.draft_info(engine.name))

    def dispose(self, engines: list[Engine]) -> None:
        """Stop stepping and drop the engines (the list is emptied: the caller keeps
        no reference), then hand their memory back and track the baseline."""
        with self._memory.live_baseline.tracking():
            while engines:
                engine = engines.pop()
                self._worker.detach(engine)
                engine.shutdown()
                if engine.prefix_cache is not None:
                    engine.prefix_cache.close()
                del engine
            # Engines, runners and their batches reference each other: collect the
            # cycles now so the weights go back to the system with this unload.
            gc.collect()
            mlx_stats.release_cache()
