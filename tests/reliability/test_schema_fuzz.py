"""Schemathesis against the server's own OpenAPI schema: every /v1 and /admin/api
operation, with the API key, fuzzed. No response may be a 5xx or break the
schema, content type or headers it documents.

Left out: memory release/resume (a release makes every later inference a 503
until resumed: tests/api/test_release_resume.py covers them), and the three
operations that start minutes-long jobs in child processes (GGUF import,
built-in model install, quantization tasks), and the Hub operations that reach the
network (tests/integration/test_hub_downloads.py covers them against a fake Hub).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.fixtures.servers import ROOT, serve_process
from tests.reliability.conftest import LONG, Profile

KEY = "schema-key"
MODEL = "tiny-llama"
CHECKS = (
    "not_a_server_error,response_schema_conformance,content_type_conformance,"
    "response_headers_conformance"
)
# Hub search / inspect / download start talk to the real Hub (and a download would run).
HUB = r"|^/admin/api/hub/search$|^/admin/api/models/downloads(/inspect)?$"
EXCLUDED = r"release|resume|install-default|import-gguf|^/admin/api/quant/tasks$" + HUB


def schemathesis_command(url: str, profile: Profile, report: Path) -> list[str]:
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{url}/openapi.json",
        "--header",
        f"Authorization: Bearer {KEY}",
        "--checks",
        CHECKS,
        "--include-path-regex",
        "^/(v1|admin/api)/",
        "--exclude-path-regex",
        EXCLUDED,
        "--max-examples",
        str(profile.schema_examples),
        "--workers",
        "2",
        "--request-timeout",
        "60",
        "--generation-database",
        "none",
        "--no-color",
        "--report",
        "junit",
        "--report-junit-path",
        str(report),
    ]
    if not LONG:
        # Fixed seed and no coverage phase (its boundary cases alone take a minute).
        command += ["--seed", "1", "--phases", "fuzzing,stateful"]
    return command


def test_schemathesis_finds_no_server_error_or_schema_violation(
    tiny_models_dir: Path, tmp_path: Path, profile: Profile
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    # A model dir of its own: fuzzed admin calls may change its settings.
    (models / MODEL).symlink_to(tiny_models_dir / MODEL, target_is_directory=True)
    log = tmp_path / "server.log"
    flags = ("--api-key", KEY, "--max-context-window", "256")
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.reliability.st_hooks",
        "PYTHONPATH": str(ROOT),
    }
    with (
        log.open("w") as err,
        serve_process(tmp_path / "base", models, *flags, stderr=err) as (
            _,
            url,
        ),
    ):
        run = subprocess.run(
            schemathesis_command(url, profile, tmp_path / "junit.xml"),
            cwd=tmp_path,  # its own state folder goes here, not into the repo
            env=env,
            capture_output=True,
            text=True,
            timeout=3000,
        )
    output = run.stdout + run.stderr
    summary = output[output.find("SUMMARY") :] if "SUMMARY" in output else output[-3000:]
    print(summary)
    assert run.returncode == 0, output[-8000:]
    assert " passed" in summary and "failed" not in summary
    # All but the excluded operations were reached (27 of them when written).
    tested = re.search(r"Tested: (\d+)", summary)
    assert tested is not None and int(tested.group(1)) >= 20
    server_log = log.read_text()
    assert "unhandled error" not in server_log and "Traceback" not in server_log
