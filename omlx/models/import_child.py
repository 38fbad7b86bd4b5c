"""Run a model import in a child process with a memory limit.

A GGUF import dequantizes a whole model (its peak is several times the file
size), and a damaged or crafted file reaches mlx's native reader. In a child,
the serving process keeps none of that memory and survives a crash; the
child's memory counts in the server's probe while it runs (as oQ's does), and
its limit makes an import too large for the memory ceiling fail with a clear
error instead of pushing the Mac into swap.
"""

from __future__ import annotations

import logging
import multiprocessing
import resource
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from omlx.errors import ImportFailedError, OmlxError
from omlx.sizes import format_bytes

log = logging.getLogger(__name__)

# The child's floor: Python, mlx and tokenizers alone reserve a few hundred MB.
MIN_LIMIT_BYTES = 1 << 30
# Allocated once under the new limit: a platform that counts more than the
# heap against it (so nothing could run) gets the limit lifted again.
_PROBE_BYTES = 64 << 20


class ProcessTracker(Protocol):
    def track_process(self, pid: int) -> None: ...
    def untrack_process(self, pid: int) -> None: ...


def import_memory_limit(ceiling_bytes: int, used_bytes: int) -> int:
    """What an import child may allocate: what the server's memory ceiling still
    leaves (the child counts as the server), but at least MIN_LIMIT_BYTES."""
    return max(MIN_LIMIT_BYTES, ceiling_bytes - used_bytes)


def run_in_child(
    fn: Callable[..., Any],
    *args: Any,
    memory_limit_bytes: int,
    tracker: ProcessTracker | None = None,
) -> Any:
    """``fn(*args)`` in a fresh process limited to ``memory_limit_bytes``.

    Returns its result; an error in the child, running out of memory, or the
    child dying (a signal, a crash in native code) raises ImportFailedError.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(
        target=_child_main, args=(sender, memory_limit_bytes, fn, args), daemon=True
    )
    child.start()
    sender.close()  # only the child writes: a dead child now reads as EOF
    pid = child.pid
    assert pid is not None
    if tracker is not None:
        tracker.track_process(pid)
    try:
        outcome = receiver.recv()
    except EOFError:
        outcome = None
    finally:
        receiver.close()
        child.join()
        if tracker is not None:
            tracker.untrack_process(pid)
    return _result(outcome, child.exitcode, memory_limit_bytes)


def _result(outcome: tuple[str, Any] | None, exitcode: int | None, limit: int) -> Any:
    if outcome is None:
        raise ImportFailedError(_death_message(exitcode))
    kind, value = outcome
    if kind == "ok":
        return value
    if kind == "memory":
        raise ImportFailedError(
            f"the import ran out of memory: it may use {format_bytes(limit)}, what "
            "memory.max_process_memory leaves beside the loaded models; unload models "
            "or raise that setting"
        )
    message, param = value
    raise ImportFailedError(message, param=param)


def _death_message(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was stopped by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was stopped by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode} without a result"
    return (
        f"the import process {how}: the file may be corrupt, or the system ran out of "
        "memory. The server itself is unaffected."
    )


def _child_main(
    sender: Connection, limit: int, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    limit_memory(limit)
    outcome: tuple[str, Any]
    try:
        outcome = ("ok", fn(*args))
    except MemoryError:
        outcome = ("memory", None)
    except OmlxError as exc:
        outcome = ("error", (exc.message, exc.param))
    except Exception as exc:  # reported to the parent, which raises it as ImportFailedError
        log.exception("import failed")
        outcome = ("error", (f"the import failed: {type(exc).__name__}: {exc}", None))
    sender.send(outcome)
    sender.close()


def limit_memory(limit_bytes: int) -> None:
    """Cap this process's heap (RLIMIT_DATA: malloc'd and anonymous mmap'd memory).

    Not RLIMIT_AS: macOS does not enforce it, and on Linux it also counts the
    memory-mapped GGUF file and reserved-but-unused address space, so a cap low
    enough to matter would refuse imports that fit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit_bytes = min(limit_bytes, hard)
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, hard))
        bytearray(_PROBE_BYTES)
    except MemoryError:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        log.warning("this platform counts more than the heap against RLIMIT_DATA: no limit set")
    except (ValueError, OSError) as exc:
        log.warning("cannot limit the import's memory: %s", exc)
