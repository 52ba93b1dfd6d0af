"""Progress of a long run: a one-line bar on a terminal, periodic structured lines otherwise
(log files and CI stay greppable). The rate counts from the start of the handoff phase, not
from the start of the processes."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, log, stream=None, every_s: float = 5.0):
        self.total, self.log = total, log
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self.t0: float | None = None
        self._last = 0.0
        self._drawn = False

    def start(self) -> None:
        """The handoff phase begins (every endpoint is up and bootstrapped)."""
        self.t0 = self._last = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        t0 = self.t0 if self.t0 is not None else now
        rate = done / (now - t0) if now > t0 else 0.0
        if self.tty:
            width = 30
            filled = int(width * done / self.total) if self.total else width
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                              f"{rate:,.0f} handoffs/s ")
            self.stream.flush()
            self._drawn = True
        elif now - self._last >= self.every_s:
            self.log.info("progress", done=done, total=self.total, handoffs_per_s=round(rate, 1))
            self._last = now

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r" + " " * 72 + "\r")
            self.stream.flush()
