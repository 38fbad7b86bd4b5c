"""Per-model settings in ``<base>/model_settings.json``, applied without a restart.

The file maps a model's folder name (as discovery names it) to the fields it
overrides; a field left out (or ``None``) inherits the global setting. The
store is the only writer: every change is validated, checked against the
invariants below, then written atomically before it becomes visible.

Invariants: at most one model is the default; an alias names one model and
never another model's folder name.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from omlx.errors import SettingsError
from omlx.settings import GenerationSettings, SamplingSettings, Settings, write_json_atomic
from omlx.template_vars import check_template_vars

log = logging.getLogger(__name__)

MODEL_SETTINGS_FILE = "model_settings.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# The most tokens a request may draft per step: the verification forward is
# this many positions wider than a plain decode step (and gated as such).
MAX_DRAFT_TOKENS = 16


# The default KV quantization group: the one that meets issue 41's bars on the built-in
# SmolLM2 (float32 KV): 8 bits drift 0.0097 from full-precision KV over its own answer
# (groups of 64, mlx-lm's default: 0.0103, over the 0.01 bar) at 0.31x the bytes.
# With bf16 KV groups of 32 take 0.56x (8 bits) and 0.31x (4 bits), over the bytes
# bars, and 64 meets them (0.53x, 0.28x): benchmarks/README.md, "bench_kv_quant.py".
DEFAULT_KV_GROUP_SIZE = 32


@dataclass(frozen=True, slots=True)
class KVQuantSpec:
    """How a model's KV cache is quantized (mlx-lm's ``kv_bits``, ``kv_group_size``,
    ``quantized_kv_start``: a sequence's KV stays full precision until a forward leaves
    it ``start`` tokens or more; 0: quantized from its first forward on)."""

    bits: int
    group_size: int
    start: int = 0

    def describe(self) -> str:
        after = f", from {self.start} tokens on" if self.start else ""
        return f"{self.bits}-bit KV (groups of {self.group_size}{after})"


class SpeculativeSettings(BaseModel):
    """Speculative decoding for one model: ``ngram`` drafts by prompt lookup
    (copying what followed the same tokens earlier in the prompt or output);
    ``draft`` has ``draft_model`` (a model folder with the same tokenizer) propose."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft"]
    num_tokens: int = Field(4, ge=1, le=MAX_DRAFT_TOKENS)
    draft_model: str | None = Field(None, min_length=1)

    @model_serializer(mode="wrap")
    def _without_unused_draft_model(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Shown (and stored) only with "method": "draft".
        data = handler(self)
        if isinstance(data, dict) and data.get("draft_model") is None:
            data.pop("draft_model", None)
        return data

    @model_validator(mode="after")
    def _draft_model_with_draft_only(self) -> SpeculativeSettings:
        if self.method == "draft" and self.draft_model is None:
            raise PydanticCustomError(
                "draft_model", 'speculative.draft_model is required with "method": "draft"'
            )
        if self.method != "draft" and self.draft_model is not None:
            raise PydanticCustomError(
                "draft_model", 'speculative.draft_model goes only with "method": "draft"'
            )
        return self


class ModelSettings(BaseModel):
    """One model's overrides. ``None`` (or an empty collection) inherits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alias: str | None = Field(None, min_length=1, max_length=128)
    # Overrides the kind discovery detects (``ModelInfo.kind``).
    model_type: Literal["llm", "vlm", "embedding", "rerank"] | None = None
    is_default: bool = False
    # Never evicted or expired while loaded.
    pinned: bool = False
    # Idle seconds before unloading; None uses the global idle timeout.
    ttl_s: float | None = Field(None, gt=0.0)
    max_context_window: int | None = Field(None, ge=16)
    max_tokens: int | None = Field(None, ge=1)
    # Refuse (400) a max_tokens larger than the room the prompt leaves, instead of
    # clamping it to that room (what agents sending a fixed 32000 need).
    strict_max_tokens: bool = False
    # Pins this model's KV capacity (skips the load-time auto-profile).
    max_kv_tokens: int | None = Field(None, ge=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # chat_template_kwargs keys a request may not override.
    locked_template_kwargs: list[str] = Field(default_factory=list)
    # The model's sampling values win over the request's.
    force_sampling: bool = False
    # Speculative decoding (None: off); requests opt out with "speculative": false.
    speculative: SpeculativeSettings | None = None
    # KV cache quantization (mlx-lm's QuantizedKVCache), from a sequence's first token
    # unless quantized_kv_start says later: bits per value (None: full precision) and
    # values per quantization group (mlx-lm's kv_bits, kv_group_size; None:
    # DEFAULT_KV_GROUP_SIZE). Applied at the model's next load.
    kv_bits: Literal[4, 8] | None = None
    kv_group_size: Literal[32, 64, 128] | None = None
    # mlx-lm's quantized_kv_start: a sequence's KV stays full precision until it holds
    # this many tokens, then all of it is quantized (None: 0, from the first token).
    quantized_kv_start: StrictInt | None = Field(None, ge=0)
    # Let the loaders import Python code the model folder ships (an auto_map's
    # tokenization_*.py, mlx-lm's model_file): off, such a folder is refused (403).
    # Applied at the model's next load. Strict: a consent is JSON true, not "yes" or 1.
    trust_remote_code: StrictBool = False

    @property
    def kv_quant(self) -> KVQuantSpec | None:
        """The model's KV quantization (None: full-precision KV)."""
        if self.kv_bits is None:
            return None
        return KVQuantSpec(
            self.kv_bits,
            self.kv_group_size or DEFAULT_KV_GROUP_SIZE,
            self.quantized_kv_start or 0,
        )

    @property
    def draft_model(self) -> str | None:
        """The model folder proposing drafts (None: prompt lookup or no speculation)."""
        return self.speculative.draft_model if self.speculative is not None else None

    @property
    def num_draft_tokens(self) -> int:
        """Tokens each request may draft per decode step (0: no speculation)."""
        return self.speculative.num_tokens if self.speculative is not None else 0

    @field_validator("alias")
    @classmethod
    def _alias_shape(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.startswith("/"):
            raise ValueError("must not start with '/'")
        if any(ch.isspace() for ch in value):
            raise ValueError("must not contain whitespace")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Settings change over the admin API too: same rule as a request's kwargs.
        check_template_vars(value)
        return value

    def overrides(self) -> dict[str, Any]:
        """The fields set away from their defaults, as stored in the file."""
        return self.model_dump(mode="json", exclude_defaults=True)


def parse_model_settings(data: ModelSettings | Mapping[str, Any]) -> ModelSettings:
    """Validate ``data``; raises ``SettingsError`` whose message starts with the field."""
    if isinstance(data, ModelSettings):
        return data
    if not isinstance(data, Mapping):
        raise SettingsError(f"model settings must be an object, not {type(data).__name__}")
    try:
        return ModelSettings.model_validate(dict(data))
    except ValidationError as exc:
        raise _settings_error(exc) from None


def _settings_error(exc: ValidationError) -> SettingsError:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(model settings)"
        hint = "unknown setting" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{field}: {hint} (got {err.get('input')!r})")
    first = exc.errors()[0]["loc"]
    return SettingsError("; ".join(parts), param=str(first[0]) if first else None)


class ModelSettingsStore:
    """Thread-safe per-model settings backed by one JSON file.

    Loading never raises: a missing file is empty; an unreadable or invalid
    file is logged at ERROR, kept as ``<file>.corrupt-<timestamp>``, and only
    its valid entries (none for broken JSON) are used.
    """

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.RLock()
        self._entries: dict[str, ModelSettings] = self._load()

    # ---- reads ------------------------------------------------------------------

    def get(self, name: str) -> ModelSettings:
        with self._lock:
            entry = self._entries.get(name)
        # Deep: the template kwargs dict must not be shared with the store.
        return entry.model_copy(deep=True) if entry else ModelSettings()

    def all(self) -> dict[str, ModelSettings]:
        with self._lock:
            return {n: s.model_copy(deep=True) for n, s in self._entries.items()}

    def default_model(self) -> str | None:
        with self._lock:
            return next((n for n, s in self._entries.items() if s.is_default), None)

    def alias_of(self, name: str) -> str:
        """The name clients see for ``name``: its alias, else the folder name."""
        return self.get(name).alias or name

    def resolve(self, requested: str, available: Iterable[str]) -> str | None:
        """The folder name ``requested`` refers to among ``available``, or None.

        A folder name wins over an alias that happens to spell it.
        """
        names = set(available)
        if requested in names:
            return requested
        with self._lock:
            for name, entry in self._entries.items():
                if entry.alias == requested and name in names:
                    return name
        return None

    # ---- writes -----------------------------------------------------------------

    def put(
        self,
        name: str,
        settings: ModelSettings | Mapping[str, Any],
        *,
        available: Iterable[str] = (),
    ) -> ModelSettings:
        """Replace ``name``'s settings and persist them.

        ``available`` is the discovered folder names; an alias may not equal
        one of them (nor another stored model's name) unless it is ``name``.
        Setting ``is_default`` clears it on every other model.
        Raises ``SettingsError`` naming the field.
        """
        entry = parse_model_settings(settings)
        with self._lock:
            self._check_alias(name, entry.alias, set(available))
            entries = dict(self._entries)
            if entry.is_default:
                entries = {n: _without_default(s) for n, s in entries.items()}
            entries[name] = entry
            self._commit(entries)
            return entry

    def update(
        self, name: str, changes: Mapping[str, Any], *, available: Iterable[str] = ()
    ) -> ModelSettings:
        """Merge ``changes`` into ``name``'s settings; a ``None`` value clears a field."""
        with self._lock:
            merged = {**self.get(name).overrides(), **changes}
            return self.put(name, merged, available=available)

    def reset(self, name: str) -> None:
        """Forget every override of ``name``."""
        with self._lock:
            if name in self._entries:
                entries = dict(self._entries)
                del entries[name]
                self._commit(entries)

    # ---- internals --------------------------------------------------------------

    def _check_alias(self, name: str, alias: str | None, available: set[str]) -> None:
        if alias is None or alias == name:
            return
        if alias in available or alias in self._entries:
            raise SettingsError(
                f"alias: '{alias}' is the folder name of another model", param="alias"
            )
        for other, entry in self._entries.items():
            if other != name and entry.alias == alias:
                raise SettingsError(
                    f"alias: '{alias}' is already the alias of '{other}'", param="alias"
                )

    def _commit(self, entries: dict[str, ModelSettings]) -> None:
        """Write first, then swap: a failed write leaves memory as the file is."""
        kept = {n: s for n, s in entries.items() if s.overrides()}
        write_json_atomic(self.path, {n: s.overrides() for n, s in sorted(kept.items())})
        self._entries = kept

    def _load(self) -> dict[str, ModelSettings]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.error("cannot read %s (%s); per-model settings start empty", self.path, exc)
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            self._set_aside(f"not valid JSON ({exc})")
            return {}
        if not isinstance(data, dict):
            self._set_aside(f"holds {type(data).__name__}, not an object")
            return {}
        entries, problems = _parse_entries(data)
        if problems:
            self._set_aside("; ".join(problems), keep_original=True)
        return entries

    def _set_aside(self, why: str, *, keep_original: bool = False) -> None:
        backup = _free_path(self.path.with_name(f"{self.path.name}.corrupt-{_timestamp()}"))
        try:
            if keep_original:
                shutil.copy2(self.path, backup)
            else:
                self.path.replace(backup)
        except OSError as exc:
            log.error("%s: %s; could not keep a copy (%s)", self.path, why, exc)
            return
        log.error("%s: %s; kept a copy as %s", self.path, why, backup.name)


def _parse_entries(data: dict[str, Any]) -> tuple[dict[str, ModelSettings], list[str]]:
    """Valid entries in name order, dropping what breaks the invariants."""
    entries: dict[str, ModelSettings] = {}
    problems: list[str] = []
    aliases: set[str] = set()
    has_default = False
    for name in sorted(data):
        try:
            entry = parse_model_settings(data[name])
        except SettingsError as exc:
            problems.append(f"'{name}' dropped: {exc.message}")
            continue
        alias = entry.alias
        if alias is not None and (alias in aliases or (alias != name and alias in data)):
            problems.append(f"'{name}': alias '{entry.alias}' dropped (already taken)")
            entry = entry.model_copy(update={"alias": None})
        if entry.is_default and has_default:
            problems.append(f"'{name}': is_default dropped (another model is the default)")
            entry = _without_default(entry)
        if entry.alias is not None:
            aliases.add(entry.alias)
        has_default = has_default or entry.is_default
        entries[name] = entry
    return entries, problems


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _free_path(path: Path) -> Path:
    candidate, num = path, 1
    while candidate.exists():
        candidate, num = path.with_name(f"{path.name}.{num}"), num + 1
    return candidate


def _without_default(entry: ModelSettings) -> ModelSettings:
    return entry.model_copy(update={"is_default": False}) if entry.is_default else entry


# ---- applying settings to a request --------------------------------------------------


def effective_template_kwargs(
    request_kwargs: Mapping[str, Any] | None, model: ModelSettings
) -> dict[str, Any]:
    """The model's chat template kwargs overridden by the request's.

    A request may not override a key in ``model.locked_template_kwargs``: such
    a value is ignored (logged at INFO), not an error. A locked key the model
    does not set stays unset.
    """
    result = dict(model.chat_template_kwargs)
    locked = set(model.locked_template_kwargs)
    for key, value in (request_kwargs or {}).items():
        if key in locked:
            log.info("ignoring chat_template_kwargs.%s from the request: locked for the model", key)
            continue
        result[key] = value
    return result


def effective_context_window(
    model_value: int | None, global_value: int, native: int | None = None
) -> int:
    """The model's cap (else the global one), never above the model's native window."""
    cap = model_value if model_value is not None else global_value
    return cap if native is None else min(cap, native)


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    """What a request to one model starts from: global defaults, the model's over them."""

    sampling: SamplingSettings
    generation: GenerationSettings
    # Sampling fields whose model value wins over the request's (force_sampling).
    forced: frozenset[str]
    model: ModelSettings

    def template_kwargs(self, requested: dict[str, Any] | None) -> dict[str, Any]:
        return effective_template_kwargs(requested, self.model)


def request_defaults(settings: Settings, model: ModelSettings) -> RequestDefaults:
    """Global sampling/generation defaults with ``model``'s settings over them."""
    sampling = settings.sampling.model_copy(
        update={k: getattr(model, k) for k in SAMPLING_KEYS if getattr(model, k) is not None}
    )
    generation = settings.generation
    if model.max_tokens is not None:
        generation = generation.model_copy(update={"max_tokens": model.max_tokens})
    forced = frozenset(
        k for k in SAMPLING_KEYS if model.force_sampling and getattr(model, k) is not None
    )
    return RequestDefaults(sampling, generation, forced, model)
