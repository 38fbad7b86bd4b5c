"""The batching verdict's store (engine/batching_verdict.py) on real files: a file that
does not parse or belongs to other inputs is never trusted; the probe runs again and
its answer replaces the file."""

from __future__ import annotations

import json
from pathlib import Path

from omlx.engine.batching_verdict import BatchingVerdicts


def _probe(answer: str | None, calls: list[int]):
    def probe() -> str | None:
        calls.append(1)
        return answer

    return probe


def test_a_stored_verdict_is_reused_only_for_the_same_key(tmp_path: Path) -> None:
    verdicts, model, calls = BatchingVerdicts(tmp_path / "profiles"), tmp_path / "m", []
    assert verdicts.probe_or_reuse({"a": 1}, model, _probe("differs", calls)) == ("differs", False)
    assert verdicts.probe_or_reuse({"a": 1}, model, _probe(None, calls)) == ("differs", True)
    assert verdicts.probe_or_reuse({"a": 2}, model, _probe(None, calls)) == (None, False)
    assert verdicts.probe_or_reuse({"a": 2}, model, _probe("x", calls)) == (None, True)
    # Switching back reuses the first key's verdict: each key keeps its own entry.
    assert verdicts.probe_or_reuse({"a": 1}, model, _probe(None, calls)) == ("differs", True)
    assert len(calls) == 2


def test_a_corrupt_or_malformed_file_is_probed_again_and_replaced(tmp_path: Path) -> None:
    verdicts, model, calls = BatchingVerdicts(tmp_path), tmp_path / "m", []
    path = verdicts.path_for(model, {"a": 1})
    path.write_text("{not json", encoding="utf-8")
    assert verdicts.probe_or_reuse({"a": 1}, model, _probe(None, calls)) == (None, False)
    assert json.loads(path.read_text(encoding="utf-8")) == {"key": {"a": 1}, "reason": None}
    path.write_text(json.dumps({"key": {"a": 1}, "reason": 7}), encoding="utf-8")
    assert verdicts.probe_or_reuse({"a": 1}, model, _probe("why", calls)) == ("why", False)
    assert len(calls) == 2
