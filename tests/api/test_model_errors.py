"""A model folder that cannot be loaded: a clear error, and the server keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

from tests.fixtures.servers import live_server


def test_unloadable_model_reports_why_and_others_still_work(
    tiny_models_dir: Path, tmp_path: Path, profiles_dir: Path
) -> None:
    models = tmp_path / "models"
    shutil.copytree(tiny_models_dir / "tiny-llama", models / "tiny-llama")
    bad = models / "future-arch"
    shutil.copytree(tiny_models_dir / "tiny-llama", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "no-such-arch"}))

    with live_server(tmp_path / "base", models, profiles=profiles_dir) as server:
        url = server.base_url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(2):  # a failed load leaves nothing half-loaded behind
            resp = httpx.post(url, json={**body, "model": "future-arch"}, timeout=60)
            assert resp.status_code == 500
            err = resp.json()["error"]
            assert err["code"] == "model_load_failed"
            assert "future-arch" in err["message"] and "no-such-arch" in err["message"]
        ok = httpx.post(url, json={**body, "model": "tiny-llama"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        health = httpx.get(server.base_url + "/health").json()
        assert [m["name"] for m in health["loaded_models"]] == ["tiny-llama"]
