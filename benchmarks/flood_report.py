"""The realistic flood's report (benchmarks/flood_realistic.py): each run's outcomes,
hung requests, false 400s and peaks against the ceiling, and two runs side by side."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from bench_flood import MB, MODEL

if TYPE_CHECKING:
    from flood_realistic import RunResult


def counts(result: RunResult) -> dict[str, int]:
    found = Counter(o.label for o in result.outcomes)
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != "completed", kv[0])))


def print_run(r: RunResult, bound_s: float) -> None:
    print(f"\n== {r.label}: ceiling {r.ceiling / MB:.0f} MiB ==")
    if r.dropped_settings:
        print(f"  settings this code lacks (not passed): {', '.join(r.dropped_settings)}")
    for event in r.events:
        print(f"  {event}")
    print(f"  outcomes ({len(r.outcomes)} requests, bound {bound_s:.0f} s): {counts(r)}")
    by_kind: dict[str, list[int]] = {}
    for o in r.outcomes:
        kind = o.ask.kind.split(" ")[0] if o.ask.model == MODEL else o.ask.model
        row = by_kind.setdefault(kind, [0, 0])
        row[0] += o.label == "completed"
        row[1] += 1
    print("  completed by kind: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in by_kind.items()))
    for label in counts(r):
        ended = [o for o in r.outcomes if o.label == label and label != "completed"]
        if ended:
            kinds = sorted({o.ask.kind for o in ended})
            print(f"    {label}: {', '.join(kinds)}; e.g. {ended[0].message[:150]!r}")
    hung = sum(o.label == "hung" for o in r.outcomes)
    print(f"  hung {hung} (target 0) {'ok' if hung == 0 else 'MISS'}")
    print(f"  false 400s {r.num_false_400} (target 0) {'ok' if not r.num_false_400 else 'MISS'}")
    for line in r.rechecks:
        print(f"  {line}")
    for name, value in (("max RSS", r.max_rss), ("max MLX/windowed peak", r.peaks.mlx)):
        flag = "ok" if value <= r.ceiling else "OVER"
        print(f"  {name} {value / MB:.0f} MiB = {value / r.ceiling:.3f} of the ceiling {flag}")
    print(
        f"  ({r.num_samples} RSS samples, {r.peaks.num_readings} server readings, server "
        f"footprint max {r.peaks.footprint / MB:.0f} MiB); counters {r.counters}"
    )
    print(f"  wall time {r.seconds:.1f} s")


def print_side_by_side(a: RunResult, b: RunResult) -> None:
    labels = sorted({*counts(a), *counts(b)}, key=lambda k: (k != "completed", k))
    rows = [(k, counts(a).get(k, 0), counts(b).get(k, 0)) for k in labels]
    rows += [
        ("false 400s", a.num_false_400, b.num_false_400),
        ("max RSS (MiB)", a.max_rss // MB, b.max_rss // MB),
        ("max MLX/windowed peak (MiB)", a.peaks.mlx // MB, b.peaks.mlx // MB),
        ("wall time (s)", round(a.seconds, 1), round(b.seconds, 1)),
    ]
    print(f"\n| same ceiling {a.ceiling / MB:.0f} MiB | {a.label} | {b.label} |")
    print("|---|---|---|")
    for name, x, y in rows:
        print(f"| {name} | {x} | {y} |")
    more = counts(a).get("completed", 0) - counts(b).get("completed", 0)
    print(f"completions: {more:+d} against {b.label} (target > 0) {'ok' if more > 0 else 'MISS'}")
