"""Make a recording machine-neutral without changing what a server sees that matters.

The recorder's scratch directory (``/tmp/agent-rec-XXXXXXXX``, in the agents' system
prompts and tool output) becomes ``/tmp/agent-rec-session0``: same length, so byte
counts and token counts hardly move. The ``host`` header (a random port) is dropped.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

NEUTRAL_DIR = "/tmp/agent-rec-session0"


def _replace(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list):
        return [_replace(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _replace(v, old, new) for k, v in value.items()}
    return value


def _dashed(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "-", path)


def sanitize(session: dict[str, Any]) -> dict[str, Any]:
    work_dir = session["work_dir"]
    assert len(work_dir) == len(NEUTRAL_DIR), work_dir
    clean = _replace(session, work_dir, NEUTRAL_DIR)
    # Claude Code also names its memory folder after the path, punctuation as dashes.
    clean = _replace(clean, _dashed(work_dir), _dashed(NEUTRAL_DIR))
    for request in clean["requests"]:
        request["headers"].pop("host", None)
    return clean


if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(json.dumps(sanitize(json.loads(path.read_text())), indent=1) + "\n")
