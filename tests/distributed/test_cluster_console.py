"""`omlx cluster`: the hostfile mlx.launch reads, the per-host checks (run here against
this machine: mlx.launch, and so the checks, run a host named 127.0.0.1 without ssh),
and the launch command."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from mlx._distributed_utils.common import Hostfile

from omlx.cli import _parser
from omlx.distributed.hosts import compare, local_facts
from tests.distributed.conftest import TP_MODEL
from tests.fixtures.servers import ROOT


def omlx(base: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omlx.cli", "--base-path", str(base), "cluster", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_hostfile_is_the_one_mlx_launch_reads(tmp_path: Path) -> None:
    out = tmp_path / "hosts.json"
    done = omlx(
        tmp_path, "hostfile", "--host", "mac1=10.0.0.1", "--host", "mac2=10.0.0.2", "-o", str(out)
    )
    assert done.returncode == 0, done.stderr
    hosts = Hostfile.from_file(out).hosts
    assert [(h.ssh_hostname, h.ips) for h in hosts] == [
        ("mac1", ["10.0.0.1"]),
        ("mac2", ["10.0.0.2"]),
    ]
    assert json.loads(out.read_text())["backend"] == "ring"


def test_a_bad_host_address_is_refused_clearly(tmp_path: Path) -> None:
    done = omlx(
        tmp_path,
        "hostfile",
        "--host",
        "mac1=10.0.0",
        "--host",
        "mac2=10.0.0.2",
        "-o",
        str(tmp_path / "h.json"),
    )
    assert done.returncode == 2
    assert "'10.0.0' is not an IP address" in done.stderr


def _hostfile(tmp_path: Path, *names: str) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"hosts": [{"ssh": n, "ips": ["127.0.0.1"]} for n in names]}))
    return path


def _on_hosts(
    tmp_path: Path, verb: str, hostfile: Path, model: str, model_dir: Path, *more: str
) -> subprocess.CompletedProcess:
    """``omlx cluster VERB`` for ``model`` over the hosts of ``hostfile``."""
    where = ("--hostfile", str(hostfile), "--model", model, "--model-dir", str(model_dir))
    return omlx(tmp_path, verb, *where, *more)


def test_check_passes_when_every_host_has_the_model(tmp_path: Path, split_models_dir: Path) -> None:
    hostfile = _hostfile(tmp_path, "127.0.0.1", "127.0.0.1")
    done = _on_hosts(tmp_path, "check", hostfile, TP_MODEL, split_models_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"all 2 hosts can serve '{TP_MODEL}'" in done.stdout


def test_check_names_the_host_without_the_model_and_the_unreachable_one(
    tmp_path: Path, split_models_dir: Path
) -> None:
    hostfile = _hostfile(tmp_path, "127.0.0.1", "no-such-host.invalid")
    done = _on_hosts(tmp_path, "check", hostfile, "not-there", split_models_dir)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0].startswith("rank 0 127.0.0.1") and "no model 'not-there'" in lines[0]
    assert lines[1].startswith("rank 1 no-such-host.invalid: unreachable: ssh")
    assert "2 of 2 hosts cannot serve 'not-there'" in done.stderr


def test_other_versions_or_another_copy_of_the_model_are_named(split_models_dir: Path) -> None:
    ours = local_facts(TP_MODEL, [split_models_dir])
    older = {**ours, "mlx": "0.20.0"}
    assert compare(ours, older, TP_MODEL) == [f"mlx 0.20.0 (first host: {ours['mlx']})"]
    other_copy = {**ours, "model": {**ours["model"], "bytes": ours["model"]["bytes"] + 1}}
    assert compare(ours, other_copy, TP_MODEL) == [
        f"its copy of '{TP_MODEL}' differs from the first host's"
    ]


def test_command_starts_omlx_serve_distributed_under_mlx_launch(
    tmp_path: Path, split_models_dir: Path
) -> None:
    hostfile = _hostfile(tmp_path, "127.0.0.1", "127.0.0.1")
    done = _on_hosts(tmp_path, "command", hostfile, TP_MODEL, split_models_dir, "--mode", "tensor")
    argv = shlex.split(done.stdout)
    assert argv[:3] == ["mlx.launch", "--hostfile", str(hostfile)]
    serve = argv[argv.index("--") + 3 :]  # after "-- -m omlx.cli"
    args = _parser().parse_args(serve)
    assert (args.command, args.distributed, args.distributed_mode) == ("serve", TP_MODEL, "tensor")
    assert args.model_dirs == [str(split_models_dir)]
