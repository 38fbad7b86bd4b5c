"""A model's draft model (speculative decoding with ``"method": "draft"``):
checked when the setting changes, loaded with the model through the same
loader as every LLM (mlx-lm's ``load``), counted by the model's memory guard,
and dropped with it.

The guard counts the draft by its KV: every request's tokens are held by both
models, so the KV bytes per token the front door, the forward gate and the
KV capacity price are the target's plus the draft's. The draft's weights are
in every memory reading once loaded (the live baseline) and in the pool's
weights budget (``AttachedDraft.weights_bytes``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omlx.errors import ModelLoadError, SettingsError
from omlx.models.discovery import ModelInfo

if TYPE_CHECKING:
    from omlx.models.loader import LoadedModel

log = logging.getLogger(__name__)

FIELD = "speculative.draft_model"


@dataclass(frozen=True, slots=True)
class AttachedDraft:
    """The draft model an engine decodes with."""

    name: str
    weights_bytes: int
    kv_bytes_per_token: int


def check_draft_setting(
    target: str, changes: Mapping[str, Any], available: Mapping[str, ModelInfo]
) -> None:
    """A 400 (``SettingsError`` naming ``speculative.draft_model``) when the
    changes name a draft model that cannot draft for ``target``. Shapes the
    settings' own validation refuses are left to it."""
    spec = changes.get("speculative")
    if not isinstance(spec, Mapping) or spec.get("method") != "draft":
        return
    name = spec.get("draft_model")
    if isinstance(name, str) and name:
        check_draft_model(available.get(target), available.get(name), name)


def check_draft_model(target: ModelInfo | None, draft: ModelInfo | None, name: str) -> None:
    if draft is None:
        raise SettingsError(
            f"{FIELD}: no model '{name}' in the model directories (GET /v1/models lists them)",
            param=FIELD,
        )
    if draft.kind != "llm":
        raise SettingsError(
            f"{FIELD}: '{name}' is a {draft.kind} model; a draft model must be a text LLM",
            param=FIELD,
        )
    if target is None:
        return
    mismatch = vocabulary_mismatch(target.path, draft.path)
    if mismatch is not None:
        raise SettingsError(
            f"{FIELD}: '{name}' cannot draft for '{target.name}': {mismatch}; pick a draft "
            "model with the same tokenizer (the same model family)",
            param=FIELD,
        )


def vocabulary_mismatch(target: Path, draft: Path) -> str | None:
    """Why the two folders' tokenizers differ (None: the same vocabulary)."""
    mine, theirs = _vocabulary(target), _vocabulary(draft)
    if mine is None or theirs is None:
        return "its tokenizer cannot be compared (no tokenizer.json in both folders)"
    if len(mine) != len(theirs):
        return f"its vocabulary has {len(theirs)} tokens, the model's {len(mine)}"
    if mine != theirs:
        differ = sum(1 for token, i in theirs.items() if mine.get(token) != i)
        return f"{differ} of its {len(theirs)} tokens have other ids than the model's"
    return None


def _vocabulary(folder: Path) -> dict[str, int] | None:
    """tokenizer.json's token -> id map, added tokens included (None: unreadable)."""
    try:
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, list):  # unigram: [token, score] pairs by id
        vocab = {str(entry[0]): i for i, entry in enumerate(vocab)}
    if not isinstance(vocab, dict):
        return None
    added = {str(t.get("content")): t.get("id") for t in data.get("added_tokens") or []}
    return {**vocab, **added}


def weights_with_draft(engine: Any) -> int:
    """A loaded model's weights, its draft model's included."""
    draft = getattr(engine, "draft", None)
    return int(engine.loaded.weights_bytes()) + (draft.weights_bytes if draft is not None else 0)


def attach_draft(engine: Any, info: ModelInfo | None) -> AttachedDraft | None:
    """MLX thread: load ``info`` as ``engine``'s draft model (None: drop the draft),
    count it in the engine's guard and start drafting with it. A draft that
    cannot load leaves the engine on prompt lookup, logged (the model serves)."""
    dims = engine.guard.dims
    if info is None:
        engine.use_draft(None)
        engine.guard.dims = dataclasses.replace(dims, draft_kv_bytes_per_token=0)
        return None
    try:
        # The settings file may have been edited by hand: the API's checks again.
        check_draft_model(engine.loaded.info, info, info.name)
        loaded = _load(info)
    except (ModelLoadError, SettingsError) as exc:
        log.error("draft model %s for %s not loaded (%s): drafting by prompt lookup", info.name,
                  engine.name, exc)  # fmt: skip
        engine.use_draft(None)
        engine.guard.dims = dataclasses.replace(dims, draft_kv_bytes_per_token=0)
        return None
    from omlx.memory.dims import guard_dims

    draft_dims = guard_dims(
        loaded.config, kv_dtype_bytes=loaded.activation_bytes(), model=info.name
    )
    from omlx.engine.kv_measure import with_measured_kv

    kv = with_measured_kv(draft_dims, loaded.model, info.name).kv_bytes_per_token
    engine.guard.dims = dataclasses.replace(dims, draft_kv_bytes_per_token=kv)
    engine.use_draft(loaded.model)
    log.info("%s drafts with %s (%d KV bytes per token more)", engine.name, info.name, kv)
    return AttachedDraft(info.name, loaded.weights_bytes(), kv)


def _load(info: ModelInfo) -> LoadedModel:
    from omlx.engine.draft_model import plain_kv_model
    from omlx.models.loader import load_model

    loaded = load_model(info)
    if loaded.vision is not None or not plain_kv_model(loaded.model):
        raise ModelLoadError(
            f"'{info.name}' cannot be a draft model: its cache is not plain attention KV"
        )
    return loaded
