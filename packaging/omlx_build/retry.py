"""Retries for the macOS tools that fail for reasons outside the build.

`hdiutil create` fails now and then with "Resource busy" on hosted runners (a disk
arbitration race), and `codesign --timestamp` needs Apple's timestamp server, which does
not always answer. Both succeed when simply run again; every retry is logged, so a run
that needed one says so.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from omlx_build.project import BuildError

T = TypeVar("T")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Retry:
    tries: int = 4
    # Waited before the second try; each later wait is one step longer (5, 10, 15 s).
    delay_s: float = 5.0

    def run(
        self,
        action: Callable[[], T],
        what: str,
        log: Callable[[str], None] = _log,
        sleep: Callable[[float], None] = time.sleep,
    ) -> T:
        """``action()``'s result; a BuildError from it is retried up to ``tries`` times."""
        for attempt in range(1, self.tries + 1):
            try:
                return action()
            except BuildError as exc:
                reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else "no message"
                if attempt == self.tries:
                    raise BuildError(
                        f"{what} failed {self.tries} times; the last time: {exc}"
                    ) from exc
                wait_s = self.delay_s * attempt
                log(
                    f"retry: {what} failed (try {attempt} of {self.tries}): {reason}; "
                    f"trying again in {wait_s:g} s"
                )
                sleep(wait_s)
        raise AssertionError("unreachable: the loop returns or raises")


# The build's policy for hdiutil and timestamped codesign (a frozen value, not state).
TOOL_RETRY = Retry()
