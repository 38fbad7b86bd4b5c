"""hdiutil create and timestamped codesign are retried, each retry logged, and give up with
the tool's own error after the last try.

hdiutil and codesign exist only on macOS: here each is a stand-in script on PATH that fails
the way the real tool does on a hosted runner ("Resource busy", an unreachable timestamp
server) a set number of times, then succeeds. Everything between build.py's functions
and the tool (the subprocess, its exit status and stderr) is the real code path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packaging"))

from omlx_build import dmg  # noqa: E402
from omlx_build.project import BuildError  # noqa: E402
from omlx_build.retry import Retry  # noqa: E402
from omlx_build.signing import ADHOC, sign_app  # noqa: E402

NO_WAIT = Retry(tries=4, delay_s=0)
# The first 8 bytes of an arm64 Mach-O file: what the signing plan looks for.
MACHO_HEAD = bytes.fromhex("cffaedfe0c000001") + bytes(24)


def _stand_in(bin_dir: Path, tool: str, failures: int, error: str, on_success: str = "") -> Path:
    """``tool`` on PATH: fails ``failures`` times with ``error`` on stderr, then succeeds.
    Every call's arguments are appended to the returned log."""
    calls = bin_dir / f"{tool}.calls"
    script = bin_dir / tool
    script.write_text(
        f"""#!/bin/sh
echo "$*" >> "{calls}"
if [ "$(wc -l < "{calls}")" -le {failures} ]; then echo "{error}" >&2; exit 1; fi
{on_success}
"""
    )
    script.chmod(0o755)
    return calls


@pytest.fixture
def bin_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}:{Path('/usr/bin')}:{Path('/bin')}")
    return folder


def _stage(tmp_path: Path) -> Path:
    stage = tmp_path / "stage"
    (stage / "omlx.app" / "Contents").mkdir(parents=True)
    return stage


def test_hdiutil_create_is_retried_after_resource_busy(bin_dir, tmp_path, capfd):
    busy = "hdiutil: create failed - Resource busy"
    # The real tool writes the image to its last argument.
    calls = _stand_in(bin_dir, "hdiutil", 2, busy, on_success='eval "touch \\"\\${$#}\\""')
    out = dmg.hdiutil_image(_stage(tmp_path), tmp_path / "omlx-1.0.0.dmg", "omlx", NO_WAIT)
    assert out.is_file()
    assert len(calls.read_text().splitlines()) == 3
    logged = [line for line in capfd.readouterr().err.splitlines() if line.startswith("retry:")]
    assert logged == [
        f"retry: hdiutil create failed (try 1 of 4): hdiutil failed (1): {busy}; "
        "trying again in 0 s",
        f"retry: hdiutil create failed (try 2 of 4): hdiutil failed (1): {busy}; "
        "trying again in 0 s",
    ]


def test_hdiutil_create_gives_up_after_the_last_try_with_its_error(bin_dir, tmp_path):
    calls = _stand_in(bin_dir, "hdiutil", 99, "hdiutil: create failed - Resource busy")
    with pytest.raises(BuildError, match=r"hdiutil create failed 4 times.*Resource busy"):
        dmg.hdiutil_image(_stage(tmp_path), tmp_path / "omlx.dmg", "omlx", NO_WAIT)
    assert len(calls.read_text().splitlines()) == 4


def _app(tmp_path: Path) -> Path:
    app = tmp_path / "omlx.app"
    library = app / "Contents" / "Resources" / "lib" / "python3.12" / "mlx" / "core.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(MACHO_HEAD)
    return app


def test_a_timestamped_signature_is_retried_when_the_timestamp_server_fails(
    bin_dir, tmp_path, capfd
):
    app = _app(tmp_path)
    no_server = "core.so: The timestamp service is not available."
    calls = _stand_in(bin_dir, "codesign", 1, no_server)
    assert sign_app(app, "Developer ID Application: omlx (TEAM)", retry=NO_WAIT) == 2
    signed = [line.split()[-1] for line in calls.read_text().splitlines()]
    library = str(app / "Contents/Resources/lib/python3.12/mlx/core.so")
    assert signed == [library, library, str(app), str(app)]  # the retry, then app, verify
    err = capfd.readouterr().err
    assert "retry: codesign core.so failed (try 1 of 4): codesign --force --timestamp" in err
    assert no_server in err


def test_an_ad_hoc_signature_failure_is_not_retried(bin_dir, tmp_path):
    app = _app(tmp_path)
    calls = _stand_in(bin_dir, "codesign", 99, "core.so: invalid or unsupported format")
    with pytest.raises(BuildError, match="unsupported format"):
        sign_app(app, ADHOC, retry=NO_WAIT)
    assert len(calls.read_text().splitlines()) == 1
