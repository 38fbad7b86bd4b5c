"""`omlx launch claude|codex|opencode [-- ARGS]`: start a coding agent pointed at the
running server (base URL, key and model in its environment, see omlx/launch.py)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

import httpx

from omlx.agent_context import context_warning
from omlx.errors import OmlxError
from omlx.launch import TOOLS, Connection, LaunchPlan, client_host, launch_plan
from omlx.settings import Settings


class LaunchError(OmlxError):
    pass


def add_launch_parser(sub: Any) -> None:
    launch = sub.add_parser(
        "launch",
        help="start a coding agent (claude, codex, opencode) pointed at this server",
        description="Start TOOL with its environment pointed at the running omlx server. "
        "Arguments after -- go to the tool.",
    )
    launch.add_argument("tool", choices=sorted(TOOLS))
    launch.add_argument("--model", help="the model to use (default: the server's default)")
    launch.add_argument("--url", help="the server's address (default: from the settings)")
    launch.add_argument(
        "--print",
        action="store_true",
        dest="print_only",
        help="print the environment and command instead of running the tool",
    )
    launch.set_defaults(tool_args=[])


def split_tool_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``omlx ... launch TOOL [options] -- ARGS``: (omlx's arguments, the tool's).
    Split before parsing, so our options may follow the tool's name."""
    if "launch" not in argv or "--" not in argv[argv.index("launch") :]:
        return argv, []
    cut = argv.index("--", argv.index("launch"))
    return argv[:cut], argv[cut + 1 :]


def launch_command(args: argparse.Namespace, settings: Settings) -> int:
    base_url = (args.url or _settings_url(settings)).rstrip("/")
    api_key = settings.server.api_key
    served = _served_models(base_url, api_key)
    model = _pick_model(args.model, _server_default(base_url, api_key), served)
    window = next((e.get("context_window") for e in served if e["id"] == model), None)
    window = window if isinstance(window, int) else None
    plan = launch_plan(args.tool, Connection(base_url, api_key, model, window))
    warning = context_warning(args.tool, model, window)
    if warning is not None:
        print(f"omlx: warning: {warning}", file=sys.stderr)
    if args.print_only:
        print("\n".join(plan.shell_lines()))
        return 0
    return _exec(plan, args.tool_args)


def _settings_url(settings: Settings) -> str:
    return f"http://{client_host(settings.server.host)}:{settings.server.port}"


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _server_default(base_url: str, api_key: str | None) -> str | None:
    """The model the server serves for "default" (its setting, not this process's)."""
    reply = httpx.get(f"{base_url}/v1/models/default", headers=_headers(api_key), timeout=5.0)
    return reply.json()["id"] if reply.status_code == 200 else None


def _served_models(base_url: str, api_key: str | None) -> list[dict[str, Any]]:
    """The server's /v1/models entries; a clear error when it is not there."""
    try:
        reply = httpx.get(f"{base_url}/v1/models", headers=_headers(api_key), timeout=5.0)
    except httpx.HTTPError:
        raise LaunchError(
            f"omlx is not running at {base_url}: start it with `omlx serve` (or the "
            "menu-bar app), or pass --url"
        ) from None
    if reply.status_code == 401:
        raise LaunchError(
            f"the server at {base_url} refused the key: set server.api_key "
            "(`omlx config set server.api_key KEY` or OMLX_SERVER__API_KEY) to its key"
        )
    if reply.status_code != 200:
        raise LaunchError(f"the server at {base_url} answered {reply.status_code} for /v1/models")
    return list(reply.json().get("data", []))


def _pick_model(requested: str | None, default: str | None, served: list[dict[str, Any]]) -> str:
    ids = [entry["id"] for entry in served]
    if not ids:
        raise LaunchError(
            "the server has no models: install one (`omlx models install-default` or `omlx pull`)"
        )
    if requested is not None:
        if requested not in ids:
            raise LaunchError(f"no model '{requested}' on the server; it has: {', '.join(ids)}")
        return requested
    if default in ids:
        return default
    loaded = [e["id"] for e in served if e.get("state") in ("loaded", "pinned")]
    return (loaded or ids)[0]


def _exec(plan: LaunchPlan, extra: list[str]) -> int:
    program = shutil.which(plan.program)
    if program is None:
        raise LaunchError(f"'{plan.program}' is not on PATH; install it with: {plan.install_hint}")
    env = {**os.environ, **plan.env}
    sys.stdout.flush()
    os.execvpe(program, [program, *plan.args, *extra], env)
    return 0  # not reached: the tool replaced this process
