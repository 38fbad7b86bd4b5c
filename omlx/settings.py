"""Typed settings: one source of truth.

Precedence: CLI flags > environment (``OMLX_*``, nested with ``__``, e.g.
``OMLX_SERVER__PORT``) > ``<base>/settings.json`` > defaults. ``<base>`` is
``~/.omlx`` unless ``OMLX_BASE_PATH`` (or ``--base-path``) says otherwise.
This is the only module that reads ``os.environ``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from omlx.errors import SettingsError
from omlx.private_fs import make_private_dir

SETTINGS_FILE = "settings.json"
ENV_PREFIX = "OMLX_"


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(_Group):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    cors_origins: list[str] = Field(default_factory=list)
    # SSE comment keep-alive while a long prefill produces nothing.
    sse_keepalive_s: float = Field(5.0, gt=0.0, le=10.0)
    # Optional API key for /v1 (Bearer or x-api-key) and the admin panel.
    api_key: str | None = Field(None, repr=False)
    # Binding to a non-loopback address without a key is refused unless this is set.
    allow_unauthenticated_remote: bool = False
    # Request bodies larger than this get 413 before they are parsed.
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    # A chat template still rendering after this many seconds is stopped and its
    # request gets 400 (a model's template is code; real ones take milliseconds).
    template_timeout_s: float = Field(10.0, gt=0.0, le=300.0)
    # Stored Responses API responses (<base>/responses.db): the newest this many, in at
    # most this many bytes; the oldest go first. Applied at start.
    responses_store_max_count: int = Field(10_000, ge=1)
    responses_store_max_bytes: int = Field(512 * 1024 * 1024, ge=1024 * 1024)
    # The admin panel's static files; None is the repo's web/ (a frozen app sets its own).
    web_dir: Path | None = None
    # Host names (or addresses) the server also answers to besides its own; any other
    # Host header is refused (DNS rebinding). E.g. a reverse proxy's name.
    allowed_hosts: list[str] = Field(default_factory=list)

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        return [_check_host_name(v) for v in value]

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        return [_check_origin(v) for v in value]

    @model_validator(mode="after")
    def _no_open_cors_without_key(self) -> ServerSettings:
        # Any page could use the server (and its memory) from every site the user visits.
        if "*" in self.cors_origins and not self.api_key:
            raise ValueError(
                "server.cors_origins '*' lets every web site call the server; it needs "
                "server.api_key set (or list the sites' origins instead)"
            )
        return self


_HOST_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"^{_HOST_LABEL}(?:\.{_HOST_LABEL})*$")
_ORIGIN = re.compile(r"^https?://[^/?#@\s]+$")


def _check_host_name(value: str) -> str:
    """A host name or IP address, lower-cased, IPv6 without brackets."""
    name = value.strip().lower()
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if not _HOST_NAME.match(name):
        raise ValueError(
            f"{value!r} is not a host name: give a bare name or address such as "
            "'mymac.local' or '192.168.1.20' (no scheme, port, path or wildcard)"
        )
    return name


def _check_origin(value: str) -> str:
    origin = value.strip()
    if origin != "*" and not _ORIGIN.match(origin):
        raise ValueError(
            f"{value!r} is not an origin: give scheme://host[:port] such as "
            "'http://localhost:3000' (no path or trailing slash), or '*'"
        )
    return origin


class ModelSettings(_Group):
    # Empty means ``<base>/models``; resolved by ``Settings.model_dirs``.
    model_dirs: list[Path] = Field(default_factory=list)
    default_model: str | None = None
    # Import the built-in SmolLM2 when no model is found at start.
    install_default_model: bool = True
    # Load the pinned and default models in the background at start (engine/startup.py).
    load_at_start: bool = True
    # Run a model of an architecture not yet verified here (type, mlx / mlx-lm
    # versions, backend) in a child process first: one whose forward kills its
    # process fails its load instead of ending the server (engine/arch_probe.py).
    probe_new_architectures: bool = True
    # Unload a model idle this long (seconds; per-model ttl_s wins). None: never.
    idle_timeout_s: float | None = Field(None, gt=0.0)
    # Hugging Face Hub downloads: a mirror's URL (unset: HF_ENDPOINT, else huggingface.co)
    # and a token for gated or private repos (unset: HF_TOKEN or `hf auth login`'s).
    hf_endpoint: str | None = None
    hf_token: str | None = Field(None, repr=False)
    # Hosts (globs, e.g. "images.example.com", "*.example.org") whose http(s) image
    # URLs chat requests may name for the server to fetch. Empty: none (send images
    # inline as data URLs); the server would otherwise fetch on a web page's behalf.
    image_url_allowlist: list[str] = Field(default_factory=list)
    # Anthropic model names no model here is called (Claude Code asks for
    # "claude-sonnet-4-5"): glob pattern -> local model; empty/None: the default model.
    anthropic_aliases: dict[str, str | None] = Field(
        default_factory=lambda: dict[str, str | None]({"claude-*": None})
    )

    @field_validator("anthropic_aliases")
    @classmethod
    def _aliases(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        if any(not pattern.strip() for pattern in value):
            raise ValueError('every pattern must be non-empty, e.g. {"claude-*": ""}')
        return {p.strip(): (t.strip() or None) if t else None for p, t in value.items()}

    @field_validator("hf_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if not re.match(r"^https?://[^/?#\s]+(/[^?#\s]*)?$", value.strip()):
            raise ValueError(
                f"{value!r} is not a Hub URL: give http(s)://host[/path], e.g. "
                "'https://hf-mirror.com'"
            )
        return value.strip().rstrip("/")


class SchedulerSettings(_Group):
    max_concurrent_requests: int = Field(8, ge=1, le=256)
    # Requests waiting beyond this get 503 + Retry-After instead of queueing.
    max_queued_requests: int = Field(256, ge=0)
    # Prompt tokens per prefill chunk; smaller keeps decode of others flowing.
    prefill_step_size: int = Field(512, ge=16, le=65536)
    # While idle, requests arriving together are gathered until none came for
    # burst_window_ms (and at most burst_max_ms after the first), so a burst
    # prefills as one batch. 0 starts every request at once.
    burst_window_ms: float = Field(5.0, ge=0.0, le=1000.0)
    burst_max_ms: float = Field(25.0, ge=0.0, le=10000.0)
    # How requests execute (omlx/engine/strategy.py): "auto" picks by backend (the
    # CPU's measured fast paths; the plain batched path on Metal); "plain" or
    # "fast_paths" force one, to measure it.
    execution_strategy: Literal["auto", "plain", "fast_paths"] = "auto"


class SamplingSettings(_Group):
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)


class GenerationSettings(_Group):
    max_context_window: int = Field(32768, ge=16)
    # Used when a request does not say max_tokens.
    max_tokens: int = Field(4096, ge=1)


def _check_size(value: str | int, field: str, *, allow_auto: bool) -> str | int:
    from omlx.sizes import parse_byte_size

    if allow_auto and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    # Percentages are checked against a stand-in total; the real RAM is applied at start.
    parse_byte_size(value, total_bytes=1 << 40, field=field)
    return value


class MemorySettings(_Group):
    # The hard ceiling itself: "auto" (RAM minus a reserve that grows with RAM),
    # "NN%" of RAM, or a size such as "24GB".
    max_process_memory: str | int = "auto"
    soft_fraction: float = Field(0.85, gt=0.0, le=1.0)
    # Room for transients no estimate models (seed 000 measured GBs on big MoE models):
    # "auto" = each model's measured worst step transient x 1.25 (at least 64 MiB; 1 GiB
    # when its capacity is pinned and nothing was measured), or a size that pins it.
    prefill_transient_margin: str | int = "auto"
    poll_interval_s: float = Field(1.0, gt=0.0, le=60.0)
    # Budget for loaded weights across models ("auto": the hard limit itself).
    max_model_memory: str | int = "auto"
    # KV tokens a model may hold at once; unset = measured by the auto-profile at load.
    max_kv_tokens: int | None = Field(None, ge=16)

    @field_validator("max_model_memory")
    @classmethod
    def _weights(cls, value: str | int) -> str | int:
        return _check_size(value, "max_model_memory", allow_auto=True)

    @field_validator("max_process_memory")
    @classmethod
    def _ceiling(cls, value: str | int) -> str | int:
        return _check_size(value, "max_process_memory", allow_auto=True)

    @field_validator("prefill_transient_margin")
    @classmethod
    def _margin(cls, value: str | int) -> str | int:
        return _check_size(value, "prefill_transient_margin", allow_auto=True)


class CacheSettings(_Group):
    enabled: bool = True
    # Tokens per block; only full blocks are shared (plus a prompt's partial tail).
    block_size: int = Field(256, ge=16, le=8192)
    # RAM tier shared by all loaded models: bytes ("4GB") or "NN%" of RAM.
    hot_cache_max_size: str | int = "10%"
    hot_cache_mode: Literal["write-back", "write-through", "hot-only"] = "write-back"
    # Empty means ``<base>/cache``.
    ssd_cache_dir: Path | None = None
    # Bytes, or "auto": ``ssd_auto_fraction`` of the disk space the cache could use.
    ssd_cache_max_size: str | int = "auto"
    ssd_auto_fraction: float = Field(0.1, gt=0.0, le=0.9)

    @field_validator("hot_cache_max_size")
    @classmethod
    def _hot(cls, value: str | int) -> str | int:
        return _check_size(value, "hot_cache_max_size", allow_auto=False)

    @field_validator("ssd_cache_max_size")
    @classmethod
    def _ssd(cls, value: str | int) -> str | int:
        return _check_size(value, "ssd_cache_max_size", allow_auto=True)


class AppSettings(_Group):
    """The desktop app (app/): the server ignores this group."""

    # Where the app looks for a newer release (a JSON feed, app/update_feed.py). None: the
    # project's releases, as the app was built with (Info.plist OMLXUpdateFeed); empty or
    # "off": never check (no network call).
    update_feed: str | None = None

    @field_validator("update_feed")
    @classmethod
    def _feed(cls, value: str | None) -> str | None:
        if value is None:
            return None
        url = value.strip()
        if url.lower() == "off":  # what a form or `omlx config set` can say for ""
            return ""
        if url and not re.match(r"^https?://[^/?#\s]+(/[^\s]*)?$", url):
            raise ValueError(
                f"{value!r} is not a feed URL: give http(s)://host/path, e.g. "
                "'https://example.com/omlx-update.json', or 'off' to never check"
            )
        return url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    base_path: Path = Path("~/.omlx")
    server: ServerSettings = Field(default_factory=ServerSettings)
    models: ModelSettings = Field(default_factory=ModelSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    app: AppSettings = Field(default_factory=AppSettings)

    @model_validator(mode="after")
    def _expand_paths(self) -> Settings:
        object.__setattr__(self, "base_path", self.base_path.expanduser())
        return self

    @property
    def model_dirs(self) -> list[Path]:
        dirs = self.models.model_dirs or [self.base_path / "models"]
        return [d.expanduser() for d in dirs]

    @property
    def settings_path(self) -> Path:
        return self.base_path / SETTINGS_FILE

    @property
    def model_settings_path(self) -> Path:
        return self.base_path / "model_settings.json"

    @property
    def cache_dir(self) -> Path:
        return (self.cache.ssd_cache_dir or self.base_path / "cache").expanduser()

    @property
    def log_dir(self) -> Path:
        return self.base_path / "logs"


class _FileSource(PydanticBaseSettingsSource):
    """The parsed settings.json, lowest priority above defaults."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]):
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def _sourced(file_data: dict[str, Any] | None, *, use_env: bool) -> type[Settings]:
    """Settings reading init kwargs, then (optionally) the environment, then file data."""

    class _Sourced(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings] if use_env else [init_settings]
            if file_data:
                sources.append(_FileSource(settings_cls, file_data))
            return tuple(sources)

    return _Sourced


def resolve_base_path(cli_base: str | Path | None = None) -> Path:
    raw = cli_base or os.environ.get(ENV_PREFIX + "BASE_PATH") or "~/.omlx"
    return Path(raw).expanduser()


def read_settings_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
    except json.JSONDecodeError as exc:
        raise SettingsError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}. "
            "Fix or delete the file."
        ) from exc
    except OSError as exc:
        raise SettingsError(f"cannot read {path}: {exc.strerror}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"{path} must hold a JSON object, not {type(data).__name__}")
    data.pop("base_path", None)  # the file lives in the base path; it cannot move it
    return data


def load_settings(cli: dict[str, Any] | None = None) -> Settings:
    """Build settings from CLI overrides (nested dict), env, the file and defaults.

    Raises ``SettingsError`` naming the offending field.
    """
    cli = dict(cli or {})
    base = resolve_base_path(cli.pop("base_path", None))
    file_data = read_settings_file(base / SETTINGS_FILE)

    try:
        loaded = _sourced(file_data, use_env=True)(**cli, base_path=base)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None
    fields = {name: getattr(loaded, name) for name in Settings.model_fields}
    return Settings.model_construct(**fields)


def describe_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(settings)"
        env = ENV_PREFIX + "__".join(str(p) for p in err["loc"]).upper()
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        hint = "unknown setting" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"invalid setting '{field}': {hint}{shown} [flag, {env} or settings.json]")
    return "; ".join(lines)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp file in the same folder, fsync, then rename over ``path``."""
    make_private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def set_file_value(base: Path, dotted_key: str, value: Any) -> dict[str, Any]:
    """Set one ``group.field`` in settings.json after validating the result."""
    path = base / SETTINGS_FILE
    data = read_settings_file(path)
    node = data
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SettingsError(f"'{part}' in {path} is not an object")
    node[leaf] = value
    try:
        # The file alone: an environment variable must not fail (or pass) it.
        _sourced(None, use_env=False)(**data, base_path=base)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None
    write_json_atomic(path, data)
    return data


# `omlx router` is its own program, configured by flags, not settings.json; its keys
# may come from the environment instead, to stay out of `ps`.
ROUTER_API_KEY_ENV = "OMLX_ROUTER_API_KEY"
ROUTER_BACKEND_KEYS_ENV = "OMLX_ROUTER_BACKEND_KEYS"  # JSON object {"URL": "KEY"}


def router_env_api_key() -> str | None:
    return os.environ.get(ROUTER_API_KEY_ENV) or None


def mlx_launch_env() -> tuple[str, str]:
    """What ``mlx.launch`` tells each rank: its hostfile (ring) and the JACCL
    coordinator's address ("" when unset)."""
    return os.environ.get("MLX_HOSTFILE", ""), os.environ.get("MLX_JACCL_COORDINATOR", "")


def router_env_backend_keys() -> str | None:
    return os.environ.get(ROUTER_BACKEND_KEYS_ENV) or None
