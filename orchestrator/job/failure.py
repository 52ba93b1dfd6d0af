"""The failure policy: how a command ends when it does not end well. One table (TABLE) maps
each exception a command ends on to its exit code and the one line it says on stderr;
docs/running.md ("Exit codes") and README.md say the same in words, and results.json's codes
(results.schema's EXIT_*) are the same numbers (tests/test_failure.py holds all three together).

- `ending(exc)` reads the table; `leave(exc)` says the line and exits with the code;
  `exit_now(code)` leaves without the interpreter's teardown (an interrupt's 2 s).
- A job's exception becomes its results (a sweep's row) in job.app.ended, by this table.
- A command's state (each job's exit code, a sweep's worst, a sweep's refused jobs) is one
  `Command`, handed to Hydra's task function and set for the sweep's callback (`running`),
  never a module global.

Nothing heavy is imported here (the standard library, and the two modules of the lower floors
whose exceptions the table names, profile.kinds and results.rundir, which import no more):
`python -m orchestrator` imports this module before its signal handlers are in place, and says
an interrupt with it while Hydra and the rest are still loading.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Iterator, NoReturn, Optional

from orchestrator.profile.kinds import ConfigError
from orchestrator.results.rundir import NoSpace, RunDirBusy


class Refusal(Exception):
    """Refused before start (a command line, a profile, a launcher request): one `error:`
    line, exit 2; str() is the line's text."""


class RowsFailed(Exception):
    """An aggregate (the bench, the ladder) with a row that failed: exit 1; str() is the line
    that names the rows."""


class EarlyStop(BaseException):
    """SIGINT/SIGTERM before a job's own handlers are in place (imports, composing, Hydra's
    start, between a sweep's jobs); args[0]: the signal's number. Ctrl-C's KeyboardInterrupt
    is the same as SIGINT."""

    @property
    def signum(self) -> int:
        return int(self.args[0])

    @property
    def code(self) -> int:
        return 128 + self.signum


class Stopped(BaseException):
    """A signal ended an aggregate (the bench, the ladder): the rows so far are written and its
    own line said so; args[0]: the signal's name (SIGINT, SIGTERM)."""

    @property
    def code(self) -> int:
        return 128 + signal.Signals.__members__.get(str(self.args[0]), signal.SIGINT).value


class SweepStopped(BaseException):
    """A sweep's job was interrupted: no further job starts; args: the job's exit code, the
    sweep dir."""

    @property
    def code(self) -> int:
        return int(self.args[0])

    def __str__(self) -> str:
        return str(self.args[1])


@dataclass(frozen=True)
class Rule:
    """One row of the table."""

    code: Optional[int]
    """The exit code; None: the exception's own `code` (a signal's 128 + N, a sweep's job's)."""
    line: str
    """The one line on stderr, a format of {text} (str() of the exception, or the caller's),
    {type} (its class), {signal} and {phase}; empty: nothing more to say."""
    means: str
    """What it means, as docs/running.md says it."""


_INTERRUPTED = "interrupted ({signal}) while {phase}: no job was running"

TABLE: dict[type[BaseException], Rule] = {  # the exception's class -> its ending (the first of its MRO)
    EarlyStop: Rule(
        None, _INTERRUPTED, "SIGINT / SIGTERM before a job's own handlers were in place: 130 / 143, nothing written"),
    SweepStopped: Rule(
        None, "sweep interrupted: the jobs not yet started were not run (summary.png: python -m "
        "orchestrator.report {text})", "a sweep's job was interrupted: its code (130 / 143)"),
    Stopped: Rule(
        None, "", "a signal ended the bench or the ladder: 130 / 143, the rows so far written"),
    Refusal: Rule(
        2, "error: {text}", "refused before start: a Hydra error, a range, an output dir, a rule of the rule "
        "book, a config-dir file, a launcher request; a tool's input it cannot use (replay, report)"),
    ConfigError: Rule(
        2, "error: {text}", "refused before start: a value the schema or the rule book refuses (a sweep's job: "
        "its row)"),
    RunDirBusy: Rule(
        2, "error: {text}", "refused before start: a run dir another live run holds, or another run's files; "
        "nothing written"),
    NoSpace: Rule(
        3, "error: {text}", "the disk filled after start: results.json where it still fits, no temporary file"),
    RowsFailed: Rule(
        1, "{text}", "an aggregate with a row that failed (the bench after one retry, a rung of the ladder)"),
    Exception: Rule(
        3, "job failed: {type}: {text}", "a sweep's job raised: a failed row, the sweep goes on (a single run "
        "shows the traceback)"),
}


@dataclass(frozen=True)
class Exit:
    """How a command ends: its exit code and the line it says (empty: none)."""

    code: int
    line: str


def rule(exc: BaseException) -> Rule:
    """The row of `exc`: the first class of its MRO the table names (KeyboardInterrupt is
    SIGINT's row)."""
    if isinstance(exc, KeyboardInterrupt):
        exc = EarlyStop(signal.SIGINT)
    for cls in type(exc).__mro__:
        if cls in TABLE:
            return TABLE[cls]
    raise LookupError(f"the failure table has no row for {type(exc).__name__}")


def ending(exc: BaseException, text: Optional[str] = None, phase: str = "") -> Exit:
    """The exit code and the one line `exc` ends a command with; `text` in place of str(exc)
    (a job's refusal names its config-dir file), `phase` what the command was doing."""
    if isinstance(exc, KeyboardInterrupt):
        exc = EarlyStop(signal.SIGINT)
    row = rule(exc)
    if row.code is not None:
        code = row.code
    else:
        assert isinstance(exc, (EarlyStop, Stopped, SweepStopped))  # the rows that carry their own
        code = exc.code
    sig = signal.Signals(exc.signum).name if isinstance(exc, EarlyStop) else ""
    return Exit(code, row.line.format(text=str(exc) if text is None else text, type=type(exc).__name__,
                                        signal=sig, phase=phase))


def unforeseen(exc: BaseException) -> bool:
    """Whether `exc` has no row of its own (only the catch-all: a single run shows its
    traceback, a sweep records a failed row)."""
    return rule(exc) is TABLE[Exception]


def say(end: Exit) -> None:
    if end.line:
        print(end.line, file=sys.stderr, flush=True)


def tell(exc: BaseException, text: Optional[str] = None, phase: str = "") -> int:
    """Say `exc`'s line on stderr; its exit code (for a `main()` that returns its code)."""
    end = ending(exc, text, phase)
    say(end)
    return end.code


def leave(exc: BaseException, text: Optional[str] = None, phase: str = "") -> NoReturn:
    """Say `exc`'s line on stderr and exit with its code (SystemExit)."""
    raise SystemExit(tell(exc, text, phase))


def hydra_exit(exc: SystemExit, started: bool) -> SystemExit:
    """Hydra's own SystemExit as the command's: its exit 1 before a job started is a refusal
    the pre-check did not foresee (Hydra printed why): exit 2, as every refusal; any other as
    it is."""
    if exc.code == 1 and not started:
        return SystemExit(rule(Refusal()).code)
    return exc


def exit_now(code: int, logs: bool = True) -> NoReturn:
    """Leave now, without the interpreter's teardown (torch and the rest loaded, it can take
    most of a second on a loaded box, past the 2 s a stop is given): the logs (`logs`: not from
    a signal handler while modules still load) and the streams flushed first."""
    if logs:
        import logging

        logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


SIGNAL_CODES = frozenset(128 + s for s in (signal.SIGINT, signal.SIGTERM))


def exit_with(code: Optional[int]) -> None:
    """A command's end by its worst code: none (nothing ran) returns; an interrupt leaves now
    (exit_now), any other code exits (SystemExit)."""
    if code is None:
        return
    if code in SIGNAL_CODES:
        exit_now(code)
    sys.exit(code)


@dataclass(frozen=True)
class RefusedJob:
    """One job of a sweep that picked a config-dir file that cannot be composed (its row:
    refused, exit 2; orchestrator.sweep.bad_files)."""

    num: int
    """Its job number: after the jobs Hydra runs (their numbers come first)."""
    overrides: tuple[str, ...]
    """The job's overrides, as Hydra would have given them (.hydra/overrides.yaml)."""
    error: str
    """One line naming the file and what is wrong in it."""


@dataclass
class Command:
    """One command's state, from its entry point through Hydra: the task function gets it
    (a closure), the sweep's callback, which Hydra builds from conf/ (nothing can be handed to
    it), finds it with `current()` while the command runs."""

    refused: tuple[RefusedJob, ...] = ()
    """A sweep's jobs that picked a config-dir file that cannot compose (written when the
    multirun starts)."""
    jobs: list[int] = field(default_factory=list)
    """Each job's exit code, in the order the jobs ran here."""
    sweep: list[int] = field(default_factory=list)
    """A sweep's: its worst job's (read back from results.json: jobs a launcher ran elsewhere
    count), and 3 when its summary did not fit on the disk."""

    def exit_code(self) -> Optional[int]:
        """The worst code: the command's exit code (None: no job ended)."""
        codes = self.jobs + self.sweep
        return max(codes) if codes else None


_RUNNING: contextvars.ContextVar[Command] = contextvars.ContextVar("orchestrator_command")


@contextlib.contextmanager
def running(command: Command) -> Iterator[Command]:
    """`command` is the one `current()` finds until the block ends."""
    token = _RUNNING.set(command)
    try:
        yield command
    finally:
        _RUNNING.reset(token)


def current() -> Command:
    """The running command's state; a fresh one nobody reads where none runs (a Hydra app
    that set none, as the bench)."""
    return _RUNNING.get(None) or Command()
