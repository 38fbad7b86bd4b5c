"""``omlx router``: the command line of the router."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from omlx.api.auth import check_bind
from omlx.errors import SettingsError
from omlx.net import port_is_free
from omlx.router.config import (
    RouterConfig,
    build_backends,
    parse_backend_keys,
)
from omlx.settings import (
    ROUTER_API_KEY_ENV,
    ROUTER_BACKEND_KEYS_ENV,
    router_env_api_key,
    router_env_backend_keys,
)

log = logging.getLogger("omlx.router")


def add_router_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = sub.add_parser(
        "router",
        help="one endpoint in front of several omlx servers",
        description="Route OpenAI/Anthropic/Responses/Ollama requests over several omlx "
        "servers: prefix affinity first, else the least loaded; fan memory release/resume "
        "out to all.",
    )
    router.add_argument(
        "--backend",
        action="append",
        dest="backends",
        default=[],
        metavar="URL",
        help="an omlx server, e.g. http://10.0.0.2:8000 (repeatable)",
    )
    router.add_argument(
        "--backend-key",
        action="append",
        dest="backend_keys",
        default=[],
        metavar="URL=KEY",
        help=f"the API key of one backend (repeatable; visible in `ps`: prefer "
        f'{ROUTER_BACKEND_KEYS_ENV}=\'{{"URL": "KEY"}}\')',
    )
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8100)
    router.add_argument(
        "--api-key",
        help=f"require this key of clients (visible in `ps`: prefer {ROUTER_API_KEY_ENV})",
    )
    router.add_argument(
        "--allow-unauthenticated-remote",
        action="store_true",
        help="allow a non-loopback --host without an API key",
    )
    router.add_argument(
        "--poll-interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how often each backend's health, load and models are read",
    )
    router.add_argument(
        "--fanout-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="time each backend gets to release/resume memory",
    )
    router.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        default="info")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    keys = parse_backend_keys(args.backend_keys, router_env_backend_keys())
    if args.poll_interval <= 0 or args.fanout_timeout <= 0:
        raise SettingsError("--poll-interval and --fanout-timeout must be positive seconds")
    return RouterConfig(
        backends=build_backends(args.backends, keys),
        host=args.host,
        port=args.port,
        api_key=args.api_key or router_env_api_key(),
        allow_unauthenticated_remote=args.allow_unauthenticated_remote,
        poll_interval_s=args.poll_interval,
        fanout_timeout_s=args.fanout_timeout,
    )


def router_command(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        check_bind(config.host, config.api_key, config.allow_unauthenticated_remote)
    except SettingsError as exc:
        print(f"omlx router: {exc.message}", file=sys.stderr)
        return 2
    if not port_is_free(config.host, config.port):
        print(f"omlx router: {config.host}:{config.port} is already in use; pass --port",
              file=sys.stderr)  # fmt: skip
        return 1
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: the polls would drown the router's own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from omlx.router.server import RouterServer

    server = RouterServer(config)
    log.info(
        "routing %s over %s",
        server.base_url,
        ", ".join(b.url + (" (with key)" if b.key else "") for b in config.backends),
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0
