"""Markdown tables from replay.py's --json-out files (several runs: one column each).

.venv/bin/python benchmarks/agent_traffic/table.py /tmp/replay-1.json /tmp/replay-2.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _runs(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    runs = []
    for number, path in enumerate(paths, 1):
        for server, result in json.loads(Path(path).read_text()).items():
            runs.append((f"{server} (run {number})", result))
    return runs


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.2f}%"


def turns_table(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    names = [name for name, _ in runs]
    header = " | ".join(f"{n}: cached/prompt, reuse, TTFT" for n in names)
    lines = [f"| tool, turn | {header} |", "|---|" + "---|" * len(names)]
    for index, turn in enumerate(runs[0][1]["turns"]):
        cells = []
        for _, result in runs:
            other = result["turns"][index]
            cached, prompt = other["cached_tokens"], other["prompt_tokens"]
            reuse = _pct(other["reuse"]) or "-"
            if other.get("shared_reuse") is not None:
                # A later session's first turn: reuse of the prefix it shares with the last.
                reuse = f"{_pct(other['shared_reuse'])} of {other['shared_tokens']} shared"
            cells.append(f"{cached}/{prompt}, {reuse}, {other['ttft_s']:.2f} s")
        session = turn.get("session", 1)
        label = f"{turn['tool']} {'' if session == 1 else f's{session} '}#{turn['index']}"
        label += "" if turn["agent"] else " (title)"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def totals_table(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = ["| server | wall s | TTFT sum s | prompt tokens | computed | cached | lowest reuse |"]
    lines.append("|---|---|---|---|---|---|---|")
    for name, result in runs:
        rows = [(name, result["summary"])]
        # Per session too, when the run replayed several against one server.
        for number, part in (result["summary"].get("sessions") or {}).items():
            rows.append((f"{name}, session {number}", part))
        for label, s in rows:
            lines.append(
                f"| {label} | {s['wall_s']} | {s['ttft_sum_s']} | {s['prompt_tokens']} | "
                f"{s['computed_tokens']} | {s['cached_tokens']} | {_pct(s['min_reuse'])} |"
            )
    return lines


if __name__ == "__main__":
    found = _runs(sys.argv[1:])
    print("\n".join(totals_table(found)) + "\n\n" + "\n".join(turns_table(found)))
