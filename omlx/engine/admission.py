"""Whether admission is paused: one switch for the whole pool. The enforcer sets it
(memory above the soft limit); every model's step gate holds the same switch and
reads it when it admits, so nothing is copied into each engine on a change."""

from __future__ import annotations


class AdmissionSwitch:
    def __init__(self) -> None:
        self.paused = False
        # How many times admission went from open to paused.
        self.num_pauses = 0

    def set(self, paused: bool) -> None:
        if paused and not self.paused:
            self.num_pauses += 1
        self.paused = paused
