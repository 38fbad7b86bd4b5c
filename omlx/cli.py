"""`omlx serve | models | config | router`: the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import logging.handlers
import sys
from pathlib import Path
from typing import Any

from omlx import __version__
from omlx.distributed.console import add_cluster_parser
from omlx.errors import OmlxError, SettingsError
from omlx.launch_console import add_launch_parser, split_tool_args
from omlx.models.pull_console import add_pull_parser
from omlx.net import port_is_free
from omlx.private_fs import make_private_dir, restrict_umask, tighten_base_dir
from omlx.quant.console import add_quantize_parser
from omlx.router.console import add_router_parser
from omlx.settings import Settings, load_settings, resolve_base_path, set_file_value

log = logging.getLogger("omlx")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omlx", description="Local LLM server on MLX")
    parser.add_argument("--version", action="version", version=f"omlx {__version__}")
    parser.add_argument("--base-path", help="data folder (default ~/.omlx or OMLX_BASE_PATH)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the HTTP server")
    serve.add_argument(
        "--model-dir",
        action="append",
        dest="model_dirs",
        metavar="DIR",
        help="folder with model folders (repeatable)",
    )
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--cors-origin", action="append", dest="cors_origins", metavar="ORIGIN")
    serve.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        metavar="NAME",
        help="a further Host name the server answers to, e.g. a proxy's (repeatable)",
    )
    serve.add_argument("--max-concurrent-requests", type=int)
    serve.add_argument("--max-queued-requests", type=int)
    serve.add_argument("--prefill-step-size", type=int)
    serve.add_argument("--max-context-window", type=int)
    serve.add_argument("--max-tokens", type=int)
    serve.add_argument("--default-model")
    serve.add_argument(
        "--max-process-memory",
        metavar="SIZE",
        help='hard memory ceiling: "auto", "NN%%" of RAM or e.g. "24GB"',
    )
    serve.add_argument("--prefill-transient-margin", metavar="SIZE")
    serve.add_argument("--max-model-memory", metavar="SIZE")
    serve.add_argument("--max-kv-tokens", type=int, metavar="N")
    serve.add_argument(
        "--api-key",
        help="require this key on /v1 and the admin panel (visible in `ps`: prefer "
        "OMLX_SERVER__API_KEY or settings.json)",
    )
    serve.add_argument(
        "--allow-unauthenticated-remote",
        action="store_true",
        default=None,
        help="allow a non-loopback --host without an API key",
    )
    serve.add_argument("--idle-timeout", type=float, metavar="SECONDS", dest="idle_timeout_s")
    serve.add_argument(
        "--max-body-bytes", type=int, metavar="N", help="larger request bodies get 413"
    )
    serve.add_argument("--no-cache", action="store_true", help="disable the prefix cache")
    serve.add_argument("--cache-dir", metavar="DIR", dest="ssd_cache_dir")
    serve.add_argument("--hot-cache-max-size", metavar="SIZE")
    serve.add_argument("--ssd-cache-max-size", metavar="SIZE")
    serve.add_argument(
        "--no-install-default",
        action="store_true",
        help="do not import the built-in model when no model is found",
    )
    serve.add_argument(
        "--parent-fd",
        type=int,
        metavar="FD",
        help="shut down when this inherited pipe closes (the desktop app passes it)",
    )
    serve.add_argument(
        "--distributed",
        metavar="MODEL",
        help="serve MODEL split across the ranks of mlx.launch (see `omlx cluster`)",
    )
    serve.add_argument("--distributed-backend", default="ring", help="MLX backend (ring, jaccl)")
    serve.add_argument("--distributed-mode", choices=["auto", "tensor", "pipeline"], default="auto")
    serve.add_argument(
        "--no-log-stderr",
        action="store_true",
        help="log to server.log only; stderr keeps what logging misses (crashes)",
    )

    models = sub.add_parser("models", help="list, import and install models")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="models found in the model dirs")
    imp = msub.add_parser("import-gguf", help="convert a GGUF into an MLX model folder")
    imp.add_argument("file", type=Path)
    imp.add_argument("--name", help="folder name (default: the file's name)")
    imp.add_argument("--dtype", choices=["float32", "float16", "keep"], default="float32")
    inst = msub.add_parser(
        "install-default",
        help="install a built-in model: SmolLM2 (chat) or all-MiniLM-L6-v2 (--kind embedding)",
    )
    inst.add_argument("--force", action="store_true")
    inst.add_argument("--kind", choices=["llm", "embedding"], default="llm")
    rm = msub.add_parser("rm", help="delete a model folder from the model dirs")
    rm.add_argument("name", help="the model's name, as `omlx models list` shows it")

    config = sub.add_parser("config", help="show or change settings.json")
    csub = config.add_subparsers(dest="config_command", required=True)
    csub.add_parser("show", help="the effective settings (file + env + defaults)")
    setp = csub.add_parser("set", help="set KEY (e.g. server.port) to VALUE in settings.json")
    setp.add_argument("key")
    setp.add_argument("value", help="JSON value or plain string")
    add_quantize_parser(sub)
    add_pull_parser(sub)
    add_launch_parser(sub)
    add_router_parser(sub)
    add_cluster_parser(sub)
    return parser


_SERVE_FLAGS = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "log_level": ("server", "log_level"),
    "cors_origins": ("server", "cors_origins"),
    "allowed_hosts": ("server", "allowed_hosts"),
    "model_dirs": ("models", "model_dirs"),
    "default_model": ("models", "default_model"),
    "max_concurrent_requests": ("scheduler", "max_concurrent_requests"),
    "max_queued_requests": ("scheduler", "max_queued_requests"),
    "prefill_step_size": ("scheduler", "prefill_step_size"),
    "max_context_window": ("generation", "max_context_window"),
    "max_tokens": ("generation", "max_tokens"),
    "max_process_memory": ("memory", "max_process_memory"),
    "prefill_transient_margin": ("memory", "prefill_transient_margin"),
    "max_model_memory": ("memory", "max_model_memory"),
    "max_kv_tokens": ("memory", "max_kv_tokens"),
    "api_key": ("server", "api_key"),
    "allow_unauthenticated_remote": ("server", "allow_unauthenticated_remote"),
    "idle_timeout_s": ("models", "idle_timeout_s"),
    "max_body_bytes": ("server", "max_body_bytes"),
    "ssd_cache_dir": ("cache", "ssd_cache_dir"),
    "hot_cache_max_size": ("cache", "hot_cache_max_size"),
    "ssd_cache_max_size": ("cache", "ssd_cache_max_size"),
}


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Nested settings dict from the flags the user actually gave."""
    out: dict[str, Any] = {}
    if args.base_path:
        out["base_path"] = args.base_path
    for flag, (group, field) in _SERVE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out.setdefault(group, {})[field] = value
    if getattr(args, "no_install_default", False):
        out.setdefault("models", {})["install_default_model"] = False
    if getattr(args, "no_cache", False):
        out.setdefault("cache", {})["enabled"] = False
    if getattr(args, "distributed", None):
        # Split serving: the one model loads at start.
        out.setdefault("models", {})["default_model"] = args.distributed
    return out


def setup_logging(settings: Settings, to_stderr: bool = True) -> None:
    level = getattr(logging, settings.server.log_level.upper())
    root = logging.getLogger()
    root.setLevel(level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    from omlx.api.auth import RedactKeyFilter

    redact = RedactKeyFilter(lambda: settings.server.api_key)
    redact_hf = RedactKeyFilter(lambda: settings.models.hf_token)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter(LOG_FORMAT))
    stderr.addFilter(redact)
    stderr.addFilter(redact_hf)
    root.addHandler(stderr)
    try:
        make_private_dir(settings.log_dir)
        file = logging.handlers.RotatingFileHandler(
            settings.log_dir / "server.log", maxBytes=10_000_000, backupCount=5, encoding="utf-8"
        )
    except OSError as exc:
        log.warning("cannot write logs to %s: %s", settings.log_dir, exc)
        return
    file.setFormatter(logging.Formatter(LOG_FORMAT))
    file.addFilter(redact)
    file.addFilter(redact_hf)
    root.addHandler(file)
    if not to_stderr:  # only once server.log works: a record must land somewhere
        root.removeHandler(stderr)


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    from omlx.api.auth import check_bind

    cluster = None
    if args.distributed:
        from omlx.distributed.serve import distributed_role

        role = distributed_role(
            settings, args.distributed, args.distributed_backend, args.distributed_mode
        )
        if isinstance(role, int):
            return role  # a follower rank, done following
        cluster = role

    host, port = settings.server.host, settings.server.port
    try:
        check_bind(host, settings.server.api_key, settings.server.allow_unauthenticated_remote)
    except SettingsError as exc:
        print(f"omlx: {exc}", file=sys.stderr)
        return 2
    if not port_is_free(host, port):
        print(
            f"omlx: {host}:{port} is already in use (another server?); stop it or pass --port",
            file=sys.stderr,
        )
        return 1
    setup_logging(settings, to_stderr=not args.no_log_stderr)
    if args.parent_fd is not None:
        from omlx.parent_watch import watch_parent

        watch_parent(args.parent_fd)  # before start-up, which may import a model for minutes
    old_mode = tighten_base_dir(settings.base_path)
    if old_mode is not None:
        log.warning("made %s private (mode %o -> 700)", settings.base_path, old_mode)
    import mlx.core as mx

    from omlx.api.server import Server
    from omlx.blas import active_blas
    from omlx.mlxjit import enable as enable_vectorized_jit
    from omlx.models.discovery import discover_models

    # Before anything is compiled: MLX's CPU kernels are built at first use.
    jit = enable_vectorized_jit()
    log.info(
        "omlx %s, MLX %s on %s, BLAS: %s; compiled kernels: %s",
        __version__,
        mx.__version__,
        mx.default_device(),
        active_blas(),
        jit,
    )
    if settings.models.install_default_model and not discover_models(settings.model_dirs):
        from omlx.models.builtin import install_default_model

        log.info("no model found in %s: installing the built-in model", settings.model_dirs[0])
        install_default_model(settings.model_dirs[0])
    server = Server(settings, cluster=cluster)
    log.info("listening on %s (OpenAI API at %s/v1)", server.base_url, server.base_url)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0


def _models(args: argparse.Namespace, settings: Settings) -> int:
    from omlx.models.discovery import discover_models

    if args.models_command == "list":
        models = discover_models(settings.model_dirs)
        if not models:
            print(f"no models in {', '.join(str(d) for d in settings.model_dirs)}")
        for name, info in sorted(models.items()):
            print(
                f"{name}\t{info.kind}\t{info.model_type}\t{info.size_bytes / 1e6:.1f} MB"
                f"\t{info.path}"
            )
        return 0
    if args.models_command == "import-gguf":
        from omlx.models.gguf import convert_gguf

        name = args.name or args.file.name.removesuffix(".gguf")
        result = convert_gguf(args.file, settings.model_dirs[0] / name, dtype=args.dtype)
        print(f"imported {args.file} -> {result.path} ({result.model_type})")
        for kind, what in result.tensor_types.items():
            print(f"  {kind}: {what['tensors']} tensors {what['became']}")
        return 0
    if args.models_command == "rm":
        from omlx.models.pull_console import remove_model

        return remove_model(settings, args.name)
    if args.kind == "embedding":
        from omlx.embeddings.builtin import install_default_embedding_model

        out = install_default_embedding_model(settings.model_dirs[0], force=args.force)
        print(f"built-in embedding model ready at {out}")
        return 0
    from omlx.models.builtin import install_default_model

    out = install_default_model(settings.model_dirs[0], force=args.force)
    print(f"built-in model ready at {out}")
    return 0


def _config(args: argparse.Namespace, settings: Settings) -> int:
    if args.config_command == "show":
        shown = settings.model_dump(mode="json")
        if shown["server"].get("api_key"):
            shown["server"]["api_key"] = "***"  # keys never printed
        if shown["models"].get("hf_token"):
            shown["models"]["hf_token"] = "***"
        print(json.dumps(shown, indent=2))
        return 0
    try:
        value = json.loads(args.value)
    except json.JSONDecodeError:
        value = args.value
    base = resolve_base_path(args.base_path)
    set_file_value(base, args.key, value)
    secret = args.key in ("server.api_key", "models.hf_token")
    shown = '"***"' if secret else json.dumps(value)
    print(f"{args.key} = {shown} written to {base / 'settings.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # Before any file is written: settings, logs, KV blocks and models stay the user's.
    restrict_umask()
    argv, tool_args = split_tool_args(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "launch":
        args.tool_args = tool_args
    if args.command == "router":  # a front for other servers: no settings of its own
        from omlx.router.console import router_command

        return router_command(args)
    try:
        settings = load_settings(cli_overrides(args))
        if args.command == "serve":
            return _serve(settings, args)
        if args.command == "models":
            return _models(args, settings)
        if args.command == "quantize":
            from omlx.quant.console import quantize_command

            return quantize_command(args, settings)
        if args.command == "pull":
            from omlx.models.pull_console import pull_command

            return pull_command(args, settings)
        if args.command == "launch":
            from omlx.launch_console import launch_command

            return launch_command(args, settings)
        if args.command == "cluster":
            from omlx.distributed.console import cluster_command

            return cluster_command(args, settings)
        return _config(args, settings)
    except SettingsError as exc:
        print(f"omlx: {exc.message}", file=sys.stderr)
        return 2
    except OmlxError as exc:
        print(f"omlx: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
