"""One oQ job in its own process, for the task manager.

    python -m omlx.quant.worker SOURCE DEST --level oQ4 [--group-size 64]

Reports JSON lines on stdout, one object each:
``{"event": "progress", "phase": ..., "fraction": 0..1}``, then either
``{"event": "done", "result": {...}}`` (exit 0) or ``{"event": "error",
"message": ...}`` (exit 1). Anything else the libraries print goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

# Progress lines at most this often, unless the phase changes.
MIN_INTERVAL_S = 0.25


class _Reporter:
    def __init__(self, out: TextIO):
        self._out = out
        self._last: tuple[str, float] = ("", 0.0)

    def send(self, event: dict[str, Any]) -> None:
        self._out.write(json.dumps(event) + "\n")
        self._out.flush()

    def progress(self, phase: str, fraction: float) -> None:
        now = time.monotonic()
        if phase == self._last[0] and now - self._last[1] < MIN_INTERVAL_S:
            return
        self._last = (phase, now)
        self.send({"event": "progress", "phase": phase, "fraction": round(fraction, 4)})


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m omlx.quant.worker")
    parser.add_argument("source", type=Path)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--level", required=True)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--max-calibration-tokens", type=int, default=1024)
    parser.add_argument("--max-eval-tokens", type=int, default=1024)
    # The model's trust_remote_code setting (the parent read it).
    parser.add_argument("--trust-remote-code", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Our events own fd 1; library prints (mlx-lm, transformers) go to stderr.
    events = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    reporter = _Reporter(events)
    try:
        from omlx.quant.job import QuantOptions, quantize_folder

        options = QuantOptions(
            level=args.level,
            group_size=args.group_size,
            max_calibration_tokens=args.max_calibration_tokens,
            max_eval_tokens=args.max_eval_tokens,
            trust_remote_code=args.trust_remote_code,
        )
        result = quantize_folder(args.source, args.dest, options, reporter.progress)
    except Exception as exc:
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        reporter.send({"event": "error", "message": message})
        return 1
    reporter.send({"event": "done", "result": result.to_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
