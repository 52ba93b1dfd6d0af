"""Progress of a long run: a one-line bar on a terminal, periodic structured lines otherwise
(log files and CI stay greppable; the prefill endpoint reports about once a second)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, log, stream=None, every_s: float = 5.0):
        self.total, self.log = total, log
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self.t0 = self._last = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        rate = done / (now - self.t0) if now > self.t0 else 0.0
        if self.tty:
            width = 30
            filled = int(width * done / self.total) if self.total else width
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                              f"{rate:,.0f} handoffs/s ")
            self.stream.flush()
        elif now - self._last >= self.every_s:
            self.log.info("progress", done=done, total=self.total, handoffs_per_s=round(rate, 1))
            self._last = now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
