"""A served vision family whose mlx-vlm module imports a module omlx leaves optional
(multi_modality: OpenCV's cv2, models/vlm_refusals.py OPTIONAL_MODULES). Where it does
not import, a request for such a model is a 501 naming the package to install (the pin
the tests install: setup.sh TEST_OPENCV_PKG); once it imports, the same model serves."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from omlx.models.vlm_refusals import OPTIONAL_MODULES, missing_module
from tests.api.test_vision import ask, png
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_vlms import build_tiny_vlm

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-janus"


def pinned_package() -> str:
    """The OpenCV package setup.sh installs for the tests."""
    text = (ROOT / "setup.sh").read_text()
    found = re.search(r'^TEST_OPENCV_PKG="([^"]+)"$', text, re.MULTILINE)
    assert found is not None
    return found.group(1)


def ask_image(server: Server) -> httpx.Response:
    body = {"model": MODEL, "messages": ask(png(1), text="what is this?"), "max_tokens": 3}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def test_the_package_a_load_names_is_the_one_the_tests_install() -> None:
    assert OPTIONAL_MODULES["multi_modality"] == ("cv2", pinned_package())
    assert missing_module("multi_modality") is None  # installed here (setup.sh test)
    assert missing_module("llava") is None


def test_a_model_whose_module_cannot_import_says_what_to_install_then_serves_once_it_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_tiny_vlm(tmp_path / "models" / MODEL, "multi_modality", image_size=384)
    # None in sys.modules: `import cv2` raises ImportError, as where it is not installed
    # (from the server's start: it loads its one model then, in the background).
    monkeypatch.setitem(sys.modules, "cv2", None)
    # And mlx-vlm's module not imported yet (building the model above imported it).
    for name in [m for m in sys.modules if m.startswith("mlx_vlm.models.multi_modality")]:
        monkeypatch.delitem(sys.modules, name)
    with live_server(tmp_path / "base", tmp_path / "models") as server:
        refused = ask_image(server)
        assert refused.status_code == 501, refused.text
        error = refused.json()["error"]
        assert error["code"] == "model_needs_module"
        assert f"cannot load '{MODEL}'" in error["message"]
        assert "'multi_modality' needs the Python module 'cv2'" in error["message"]
        assert f"pip install --no-deps {pinned_package()}" in error["message"]
        monkeypatch.undo()
        served = ask_image(server)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] > 576  # the image's rows
