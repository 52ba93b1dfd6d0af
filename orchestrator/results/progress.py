"""The live progress line of a run on stderr: its phase (starting, bootstrapping, handoffs,
collecting), the requests verified and failed so far, the rate, the time.

On a terminal one line is redrawn in place (at most 5 times a second); elsewhere (a pipe, a
file, CI) a plain line every `every_s` seconds, and only when asked for (logging.progress,
or logging.console=true). Everything it shows is a counter the runner already has: the
prefills' pipe messages (orchestrator.job.protocol.Progress, four a second) and the
runner's own phases; nothing is added to a request's path. The rate counts from the start
of the handoff phase, not from the start of the processes. The run's log file gets a
structured `progress` event every `every_s` seconds whatever the console shows.
"""

from __future__ import annotations

import enum
import shutil
import sys
import time
from typing import Callable, Optional, TextIO

from structlog.stdlib import BoundLogger


class Mode(enum.Enum):
    live = "live"  # one line redrawn in place (a terminal)
    lines = "lines"  # a plain line every every_s (not a terminal, asked for)
    off = "off"


def mode_for(setting: Optional[bool], console: bool, stream: Optional[TextIO] = None) -> Mode:
    """logging.progress (null: auto), logging.console and where stderr goes -> the mode."""
    stream = stream or sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    if setting is False:
        return Mode.off
    if tty:
        return Mode.live
    return Mode.lines if setting or console else Mode.off


def _n(v: int) -> str:
    return f"{v:,}"


class ProgressMeter:
    """What runner.run_handoffs reports to: `stage` (the runner's phase), `start` (the
    handoff phase begins), a call per pipe Progress message (finished, verified), `tick`
    (the runner's loops, to keep the elapsed time moving), `close` (the summary follows)."""

    REDRAW_S = 0.2

    def __init__(self, total: Optional[int], log: Optional[BoundLogger] = None, stream: Optional[TextIO] = None,
                 every_s: float = 5.0, mode: Mode = Mode.live, duration_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.log, self.mode = total, log, mode
        self.stream = stream or sys.stderr
        self.every_s, self.duration_s, self.clock = every_s, duration_s, clock
        self.t_open = clock()
        self.t0: Optional[float] = None  # the handoff phase began
        self.t_end: Optional[float] = None  # it ended (the counts and the rate stop there)
        self.label = "starting"
        self.done = self.verified = 0
        self._drawn = 0.0  # when the line was last drawn (live) or written (lines)
        self._logged = self.t_open
        self._width = 0  # what the live line last took

    # ---- what the runner tells ---------------------------------------------------------
    def stage(self, label: str) -> None:
        if self.t0 is not None and self.t_end is None:
            self.t_end = self.clock()
        self.label = label
        self._show(force=True)

    def start(self) -> None:
        """The handoff phase begins (every endpoint is up and bootstrapped)."""
        self.t0 = self.clock()
        self.label = "handoffs"
        self._show(force=True)

    def __call__(self, done: int, verified: Optional[int] = None) -> None:
        self.done = done
        if verified is not None:
            self.verified = verified
        self._show()

    def tick(self) -> None:
        self._show()

    def close(self) -> None:
        if self.mode is Mode.live and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    # ---- the line ------------------------------------------------------------------------
    def rate(self, now: float) -> Optional[float]:
        now = self.t_end or now
        if self.t0 is None or now <= self.t0 or not self.done:
            return None
        return self.done / (now - self.t0)

    def line(self, now: Optional[float] = None) -> str:
        """The progress line as it stands (no control characters)."""
        now = self.clock() if now is None else now
        parts = [self.label]
        if self.t0 is None:
            parts.append(f"{now - self.t_open:.1f} s")
            return "  ".join(parts)
        ran = (self.t_end or now) - self.t0
        if self.duration_s is not None:
            parts.append(f"{min(ran, self.duration_s):.1f}/{self.duration_s:g} s")
        elif self.total:
            parts.append(f"{_n(self.done)}/{_n(self.total)} ({100 * self.done / self.total:.0f}%)")
        failed = self.done - self.verified
        parts.append(f"verified {_n(self.verified)}, failed {_n(failed)}")
        rate = self.rate(now)
        if rate is not None:
            parts.append(f"{rate:,.0f} handoffs/s")
        if self.duration_s is None:
            parts.append(f"{ran:.1f} s")
        return "  ".join(parts)

    def _show(self, force: bool = False) -> None:
        now = self.clock()
        if self.log is not None and now - self._logged >= self.every_s:
            self._logged = now
            rate = self.rate(now)
            self.log.info("progress", phase=self.label, done=self.done, verified=self.verified,
                          failed=self.done - self.verified, total=self.total,
                          handoffs_per_s=round(rate, 1) if rate is not None else None)
        if self.mode is Mode.off:
            return
        if self.mode is Mode.lines:
            if force or now - self._drawn >= self.every_s:
                self._drawn = now
                self.stream.write(f"progress: {self.line(now)}\n")
                self.stream.flush()
            return
        if not force and now - self._drawn < self.REDRAW_S:
            return
        self._drawn = now
        cols = shutil.get_terminal_size((100, 24)).columns
        text = self.line(now)[:max(10, cols - 1)]
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)
