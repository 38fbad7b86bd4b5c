"""Crash isolation (issue 41, defect 7): an architecture is run in a child process
before the server first loads it, so a forward that kills its process (mlx-lm's
phi3small segfaults on the CPU backend from 12 prompt tokens) kills the child, not
the server; the load fails with the reason and the other models keep serving.

The key is the architecture (``model_type``; a VLM's family), the mlx-lm, mlx-vlm
and MLX versions and the MLX backend. A verdict, "ok" or "crashed", is kept per key
in ``<base>/profiles/architectures.json``: a verified architecture starts no child
again, a crashed one is refused at once until a version changes (then it is probed
anew, so upgrading MLX and reloading retries it). A timeout or a Python error in the
child is not cached: the server's own load reports the error. ``models.
probe_new_architectures: false`` turns all of this off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from omlx.engine.arch_child import RAISED
from omlx.errors import ArchitectureCrashError
from omlx.models.discovery import ModelInfo
from omlx.settings import Settings, write_json_atomic

log = logging.getLogger(__name__)

VERDICTS_FILE = "architectures.json"
TIMEOUT_S = 300.0
_STDERR_TAIL = 2000


def package_version(package: str) -> str:
    """An installed distribution's version; "none" when it is not installed."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


def mlx_backend() -> str:
    """The backend MLX runs the forward on here: metal, cuda or cpu."""
    import mlx.core as mx  # deferred: the key's parts are read once per probe

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)  # MLX builds without the CUDA backend lack it
    return "cuda" if cuda is not None and cuda.is_available() else "cpu"


@dataclass(frozen=True, slots=True)
class ArchitectureKey:
    model_type: str
    mlx_lm: str
    mlx_vlm: str
    mlx: str
    backend: str

    @classmethod
    def of(cls, info: ModelInfo) -> ArchitectureKey:
        vlm = package_version("mlx-vlm") if info.kind == "vlm" else "-"
        return cls(
            info.model_type, package_version("mlx-lm"), vlm, package_version("mlx"), mlx_backend()
        )

    def text(self) -> str:
        return (
            f"{self.model_type} | mlx-lm {self.mlx_lm} | mlx-vlm {self.mlx_vlm} | "
            f"mlx {self.mlx} | {self.backend}"
        )


@dataclass(frozen=True, slots=True)
class ChildOutcome:
    returncode: int | None  # None: timed out
    stderr: str
    seconds: float

    def crash(self) -> str | None:
        """How the child died, or None when it did not crash."""
        code = self.returncode
        if code is None or code in (0, RAISED):
            return None
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"


async def run_child(info: ModelInfo, chunk: int, timeout_s: float = TIMEOUT_S) -> ChildOutcome:
    """Run arch_child.py on ``info``'s folder and wait for it (killed at the timeout)."""
    spec = json.dumps(_spec(info))
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "omlx.engine.arch_child", spec, str(chunk),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        _, err = await proc.communicate()
        return ChildOutcome(None, err.decode(errors="replace"), time.monotonic() - started)
    seconds = time.monotonic() - started
    return ChildOutcome(proc.returncode, err.decode(errors="replace"), seconds)


def _spec(info: ModelInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "path": str(info.path),
        "model_type": info.model_type,
        "kind": info.kind,
        "size_bytes": info.size_bytes,
        "trust_remote_code": info.trust_remote_code,
    }


class ArchitectureProbe:
    """Verifies a model's architecture before the pool loads it (``verify``)."""

    def __init__(self, settings: Settings, timeout_s: float = TIMEOUT_S) -> None:
        self.enabled = settings.models.probe_new_architectures
        self.path = settings.base_path / "profiles" / VERDICTS_FILE
        self._chunk = settings.scheduler.prefill_step_size
        self._timeout_s = timeout_s

    async def verify(self, info: ModelInfo) -> None:
        """Return when ``info``'s architecture may run in this process; else raise
        ArchitectureCrashError with the reason. Called after the pool admitted the
        load and before the weights are read: the child's memory is gone before the
        parent loads, so two copies of the model are never held at once (which is
        why the child does not run beside the load)."""
        if not self.enabled or info.kind not in ("llm", "vlm"):
            return
        key = ArchitectureKey.of(info)
        verdict = self._read().get(key.text())
        if verdict is not None and verdict.get("verdict") == "ok":
            return
        if verdict is not None and verdict.get("verdict") == "crashed":
            raise ArchitectureCrashError(_message(info, key, str(verdict.get("how"))))
        log.info("probing %s's architecture (%s) in a child process", info.name, key.text())
        outcome = await run_child(info, self._chunk, self._timeout_s)
        self._judge(info, key, outcome)

    def _judge(self, info: ModelInfo, key: ArchitectureKey, outcome: ChildOutcome) -> None:
        how = outcome.crash()
        if how is None and outcome.returncode is not None:
            log.info(
                "%s's architecture probe: exit %s in %.2f s",
                info.name, outcome.returncode, outcome.seconds,
            )  # fmt: skip
            if outcome.returncode == 0:
                self._record(key, {"verdict": "ok", "model": info.name})
            return
        log.error(
            "%s's architecture probe failed (%s) after %.2f s; its stderr ends:\n%s",
            info.name, how or "timed out", outcome.seconds, outcome.stderr[-_STDERR_TAIL:],
        )  # fmt: skip
        if how is None:  # timed out: a slow disk or a busy machine, maybe; not kept
            raise ArchitectureCrashError(
                f"model '{info.name}' (architecture {key.model_type}) did not finish its "
                f"first forward in the probe process within {self._timeout_s:.0f} s; omlx "
                "will not load it in the server process (the next load probes it again)"
            )
        self._record(key, {"verdict": "crashed", "model": info.name, "how": how})
        raise ArchitectureCrashError(_message(info, key, how))

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("ignoring %s (%s): every architecture is probed again", self.path, exc)
            return {}
        verdicts = data.get("verdicts") if isinstance(data, dict) else None
        return verdicts if isinstance(verdicts, dict) else {}

    def _record(self, key: ArchitectureKey, verdict: dict[str, Any]) -> None:
        verdicts = self._read()
        verdicts[key.text()] = verdict
        try:
            write_json_atomic(self.path, {"format": 1, "verdicts": verdicts})
        except OSError as exc:  # a hint that saves seconds, never a reason to fail a load
            log.warning("cannot keep the architecture verdict in %s: %s", self.path, exc)


def _message(info: ModelInfo, key: ArchitectureKey, how: str) -> str:
    return (
        f"model '{info.name}' (architecture {key.model_type}) crashed the probe process "
        f"({how}) running its first forward on this machine's MLX {key.mlx} "
        f"({key.backend}); omlx will not load it in the server process. A newer mlx / "
        "mlx-lm may fix it: upgrade, then load it again (it is probed anew)"
    )
