"""The model catalog: which models exist, what clients call them, and what each is
set to (aliases, the default model, pins, time to live, sampling defaults, context
windows, draft models). It reads the model dirs and the per-model settings; it
holds no engine and loads nothing (omlx/engine/residents.py does)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Protocol

from omlx.errors import ModelNotFoundError
from omlx.memory.fit import native_context_tokens
from omlx.models.discovery import ModelInfo, discover_models, with_kind
from omlx.models.model_settings import (
    KVQuantSpec,
    ModelSettingsStore,
    RequestDefaults,
    effective_context_window,
    request_defaults,
)
from omlx.settings import Settings

log = logging.getLogger(__name__)

# A request for this model name gets the default model (per-model is_default,
# else models.default_model), unless a model is really called that.
DEFAULT_MODEL_NAME = "default"


class LoadedWeights(Protocol):
    """A loaded model as the catalog reads it (an LLM's or an embedding model's)."""

    @property
    def info(self) -> ModelInfo: ...
    @property
    def native_context(self) -> int | None: ...


class ModelCatalog:
    """``cluster``: omlx.distributed.cluster.Cluster when one model is split across
    ranks (the catalog then holds that model alone); None when local."""

    def __init__(self, settings: Settings, cluster: Any = None) -> None:
        self.settings = settings
        self.cluster = cluster
        # Read once: a change of model dirs applies at the next start.
        self.model_dirs = settings.model_dirs
        self.model_settings = ModelSettingsStore(settings.model_settings_path)

    def available(self) -> dict[str, ModelInfo]:
        """Re-scan the model dirs (cheap: a few stat calls per folder)."""
        models = discover_models(self.model_dirs)
        if self.cluster is not None:  # one model split across ranks, and nothing else
            models = {n: i for n, i in models.items() if n == self.cluster.model}
        return models

    def resolve(self, requested: str) -> ModelInfo:
        """A folder name or alias -> the model; ModelNotFoundError lists what exists."""
        models = self.available()
        name = self.model_settings.resolve(requested, models)
        if name is None and requested == DEFAULT_MODEL_NAME:
            name = self.default_model()
        info = models.get(name) if name is not None else None
        if info is None:
            shown = sorted(self.public_name(n) for n in models)
            raise ModelNotFoundError(requested, shown)
        return self._as_set(info)

    def _as_set(self, info: ModelInfo) -> ModelInfo:
        """``info`` as its settings give it: its kind, whether its own code may run."""
        own = self.model_settings.get(info.name)
        info = with_kind(info, own.model_type)
        if own.trust_remote_code:
            info = dataclasses.replace(info, trust_remote_code=True)
        return info

    def public_name(self, name: str) -> str:
        """What clients see for a model folder: its alias, else its name."""
        return self.model_settings.alias_of(name)

    def default_model(self) -> str | None:
        return self.model_settings.default_model() or self.settings.models.default_model

    def pinned(self, name: str) -> bool:
        return self.model_settings.get(name).pinned

    def ttl_s(self, name: str) -> float | None:
        """The model's own idle time to live (None: the global idle timeout)."""
        return self.model_settings.get(name).ttl_s

    def request_defaults(self, name: str) -> RequestDefaults:
        """Global sampling/generation defaults with the model's settings over them."""
        return request_defaults(self.settings, self.model_settings.get(name))

    def context_window_for(self, loaded: LoadedWeights) -> int:
        return effective_context_window(
            self.model_settings.get(loaded.info.name).max_context_window,
            self.settings.generation.max_context_window,
            loaded.native_context,
        )

    def context_window_of(self, info: ModelInfo) -> int:
        """The window a request to the model gets, from its config.json without
        loading it (no config: the configured cap alone)."""
        try:
            config = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        return effective_context_window(
            self.model_settings.get(info.name).max_context_window,
            self.settings.generation.max_context_window,
            native_context_tokens(config) if isinstance(config, dict) else None,
        )

    def explicit_kv_tokens(self, name: str) -> int | None:
        """The KV capacity set for the model (or for every model); None: measured."""
        return self.model_settings.get(name).max_kv_tokens or self.settings.memory.max_kv_tokens

    def num_draft_tokens(self, name: str) -> int:
        """0 for a quantized-KV model: speculation steps aside (its verify step cuts
        rejected positions off plain KV layers only; building.py logs it)."""
        model = self.model_settings.get(name)
        return 0 if model.kv_quant is not None else model.num_draft_tokens

    def kv_quant(self, name: str) -> KVQuantSpec | None:
        """The model's KV quantization (None: full precision)."""
        return self.model_settings.get(name).kv_quant

    def draft_info(self, name: str) -> ModelInfo | None:
        """The draft model ``name``'s settings give it (None: none, or distributed)."""
        model = self.model_settings.get(name)
        draft = model.draft_model
        if self.cluster is not None or draft is None or model.kv_quant is not None:
            return None
        info = self.available().get(draft)
        if info is None:
            log.error("draft model %s of %s is not in the model dirs: no drafts", draft, name)
            return None
        return self._as_set(info)

    def weights_needed(self, info: ModelInfo) -> int:
        """Bytes of weights loading ``info`` brings in, its draft model's included."""
        draft = self.draft_info(info.name)
        return info.size_bytes + (draft.size_bytes if draft is not None else 0)
