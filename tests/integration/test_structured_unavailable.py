"""Without xgrammar, structured output is refused (400 with the fix), never ignored."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from tests.fixtures.servers import serve_process


def test_structured_output_without_xgrammar_is_a_400_saying_how_to_fix_it(
    tiny_models_dir: Path, tmp_path: Path
) -> None:
    shadow = tmp_path / "shadow" / "xgrammar"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'xgrammar'\")\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    with serve_process(tmp_path / "base", tiny_models_dir, env=env, stderr=subprocess.DEVNULL) as (
        _,
        url,
    ):
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
        }
        refused = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={**body, "response_format": {"type": "json_object"}},
        )
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert "xgrammar" in message and "pip install --no-deps xgrammar" in message
        free = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert free.status_code == 200
