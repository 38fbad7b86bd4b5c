"""The GitHub workflows, read as YAML: no retired runner image, and the macOS jobs wired so
the DMG built on macOS 15 is installed on macOS 26 and the benchmark never delays it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
MACOS_DMG = WORKFLOWS / "macos-dmg.yml"

# GitHub-hosted images past their retirement date (a job naming one never starts), from
# the actions/runner-images announcements. Add each one as it is announced.
RETIRED_RUNNERS = {
    "macos-11": "2024-06-28",  # actions/runner-images#9255
    "macos-12": "2024-12-03",  # actions/runner-images#10721
    "macos-13": "2025-12-04",  # actions/runner-images#13046
    "macos-14": "2026-11-02",  # actions/runner-images#13518
    "ubuntu-20.04": "2025-04-15",  # actions/runner-images#11101
    "windows-2019": "2025-06-30",  # actions/runner-images#12045
}
# The larger sizes of an image go with it (macos-14-xlarge, macos-13-large, ...).
_SIZE_SUFFIXES = ("", "-large", "-xlarge", "-arm64")


def _strings(node: Any) -> list[str]:
    """Every string scalar in a parsed YAML tree (runs-on, matrix rows, include entries)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for value in node.values() for s in _strings(value)]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return []


def retired_runners(workflow: dict[str, Any]) -> list[str]:
    """'JOB: LABEL (retired DATE)' for every retired image a job runs on or its matrix lists."""
    found = []
    for name, job in (workflow.get("jobs") or {}).items():
        labels = _strings(job.get("runs-on")) + _strings(job.get("strategy", {}).get("matrix"))
        for label in labels:
            for image, date in RETIRED_RUNNERS.items():
                if label.strip().lower() in {image + suffix for suffix in _SIZE_SUFFIXES}:
                    found.append(f"{name}: {label} (retired {date})")
    return found


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _steps_running(job: dict[str, Any], text: str) -> list[int]:
    return [i for i, step in enumerate(job["steps"]) if text in str(step.get("run", ""))]


def _step_named(job: dict[str, Any], prefix: str) -> int:
    (index,) = [i for i, s in enumerate(job["steps"]) if s.get("name", "").startswith(prefix)]
    return index


def _uses(job: dict[str, Any], action: str) -> list[tuple[int, dict[str, Any]]]:
    return [(i, s) for i, s in enumerate(job["steps"]) if s.get("uses", "").startswith(action)]


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.y*ml")), ids=lambda p: p.name)
def test_no_workflow_runs_on_a_retired_image(path: Path):
    assert retired_runners(_load(path)) == []


def test_retired_images_are_found_in_runs_on_and_in_matrices():
    workflow = yaml.safe_load(
        """
jobs:
  dmg: {runs-on: macos-14, steps: []}
  tests:
    runs-on: ${{ matrix.os }}
    strategy: {matrix: {os: [ubuntu-latest, macos-13-xlarge, macos-15]}}
    steps: []
  fine: {runs-on: [self-hosted, macos-15-intel], steps: []}
"""
    )
    assert retired_runners(workflow) == [
        "dmg: macos-14 (retired 2026-11-02)",
        "tests: macos-13-xlarge (retired 2025-12-04)",
    ]


@pytest.fixture(scope="module")
def jobs() -> dict[str, Any]:
    return _load(MACOS_DMG)["jobs"]


def test_the_dmg_is_built_on_macos_15_from_the_verified_wheels(jobs):
    build = jobs["build"]
    assert build["runs-on"] == "macos-15"
    (install,) = _steps_running(build, "build.py install-verified")
    (editable,) = _steps_running(build, "pip install --no-deps -e .")
    assert install == editable  # one step: verify, the verified set, then omlx itself
    assert _steps_running(build, "pip install -r") == []  # pip would choose macOS 15 wheels
    assert install < _step_named(build, "Build the app")


def test_the_keychain_stays_unlocked_until_codesign_has_run(jobs):
    build = jobs["build"]
    (keychain,) = _steps_running(build, "security create-keychain")
    script = build["steps"][keychain]["run"]
    assert "security set-keychain-settings -lut 21600 build.keychain" in script
    assert script.index("create-keychain") < script.index("set-keychain-settings")
    assert keychain < _step_named(build, "Build the app")


def test_the_macos_26_leg_installs_the_dmg_the_build_uploaded(jobs):
    build, leg = jobs["build"], jobs["install-macos-26"]
    assert leg["runs-on"] == "macos-26"
    assert "build" in ([leg["needs"]] if isinstance(leg["needs"], str) else leg["needs"])
    uploads = [s["with"]["name"] for _i, s in _uses(build, "actions/upload-artifact")]
    ((download_at, download),) = _uses(leg, "actions/download-artifact")
    assert download["with"]["name"] in uploads
    (mount,) = _steps_running(leg, "hdiutil attach")
    (smoke,) = _steps_running(leg, "packaging/smoke.py")
    assert download_at < mount < smoke
    assert "needs.build.outputs.version" in leg["steps"][smoke]["run"]
    assert "version" in build["outputs"]


def test_the_benchmark_runs_after_notarization_in_its_own_job(jobs):
    build, bench = jobs["build"], jobs["benchmark"]
    assert _steps_running(build, "bench_speculative") == []
    assert bench["needs"] == "build" or "build" in bench["needs"]
    assert _steps_running(bench, "bench_speculative")
    # Notarization is the build job's last work before the DMG goes up for the others.
    notarize = _step_named(build, "Notarize")
    ((upload_at, upload),) = [
        (i, s) for i, s in _uses(build, "actions/upload-artifact") if ".dmg" in s["with"]["path"]
    ]
    assert notarize < upload_at and "if" not in upload


def test_the_app_checks_the_feed_the_release_publishes(jobs):
    """The build writes this repository's releases into the app as its default feed,
    and the feed file it points at is written from the notarized DMG and uploaded."""
    build = jobs["build"]
    step = build["steps"][_step_named(build, "Build the app")]
    feed_url = step["env"]["OMLX_UPDATE_FEED"]
    assert feed_url.startswith("https://github.com/${{ github.repository }}/releases/")
    (write,) = _steps_running(build, "python -m app.update_feed")
    assert feed_url.rsplit("/", 1)[1] in build["steps"][write]["run"]
    uploads = [s["with"]["path"] for _i, s in _uses(build, "actions/upload-artifact")]
    assert any("omlx-update.json" in path for path in uploads)
    assert _step_named(build, "Notarize") < write
