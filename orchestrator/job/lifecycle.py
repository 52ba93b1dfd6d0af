"""A job's life cycle seen from the runner: how it fails to start (RunFailed), how it is
interrupted (Interrupted, Signals) and how a child is started so a Ctrl-C cannot kill it with a
traceback before it installed its own handlers (spawn)."""

from __future__ import annotations

import signal
import threading
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, Optional

from orchestrator.results.outcomes import RunFailed as RunFailed  # (the job raises it too)


class Interrupted(Exception):
    pass


class Signals:
    """SIGINT/SIGTERM handlers for a job's duration (main thread only): a signal is noted,
    and the run winds down with what it measured."""

    def __init__(self) -> None:
        self.caught: Optional[str] = None
        self._saved: dict[int, Any] = {}
        self._depth = 0  # entered again (the CLI's job, then its runner): one install, one restore

    def __enter__(self) -> Signals:
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._on)
        return self

    def _on(self, signum: int, _frame: Optional[FrameType]) -> None:
        self.caught = signal.Signals(signum).name

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)
            self._saved.clear()


def spawn(proc: BaseProcess) -> None:
    """Start a child that ignores SIGINT and SIGTERM until it installs its own handlers
    (endpoints.common.start_process): a Ctrl-C on the terminal, or a SIGTERM to the whole
    group, reaches every process, and a child still importing torch would die with a
    traceback. A spawned child starts with an empty signal mask, but keeps an ignored
    disposition (and Python then installs no KeyboardInterrupt handler). Here the signals are
    blocked meanwhile, so one that arrives during the start reaches the runner's handler."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(sigs))
    pending = signal.sigpending() & set(sigs)  # SIG_IGN would discard these: raised again below
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in sigs} if main else {}
    try:
        proc.start()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        for s in pending:
            signal.raise_signal(s)  # still blocked: delivered to the handler at the unblock
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
