"""structlog set-up: JSON lines in the run dir, a quiet console, decisions in their own file.

Called inside the task function and at the start of each endpoint process (spawned workers
and joblib/loky workers do not run module-level code of __main__). Hydra has already
configured the stdlib root logger in the task process (console + <job>.log); we keep its
handlers and give them structlog's ProcessorFormatter, so Hydra's file and ours are one. The
console shows warnings and the summary unless `logging.console=true` (or Hydra's
`hydra.verbose`) asks for every structured line there too.

Routing decisions go to decisions.jsonl, one JSON line per decision, written a step at a
time (DecisionLog: one write per step, not a logger call per request); structlog stays the
logger of events.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Optional, TextIO

import structlog

from orchestrator.results.rundir import RunFile, RunFiles, open_regular

_SHARED: list[Any] = [  # structlog processors
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]

_FIRST = ("event", "timestamp", "level", "logger", "role")
# Events the summary repeats in its own words: on the quiet console they would be said twice
# (the run dir's logs keep them).
SUMMARIZED = frozenset({"run_failed", "interrupted", "process_lost", "peer_lost", "slow_to_stop"})
# Events the console never shows: the progress line (orchestrator.results.progress) says them
FILE_ONLY = frozenset({"progress"})


class _NotSummarized(logging.Filter):
    def __init__(self, events: frozenset = SUMMARIZED):
        super().__init__()
        self.events = events

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, dict) and record.msg.get("event") in self.events)


def _event_first(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """Stable, readable key order in JSON lines: event, timestamp, level, logger, role, rest."""
    head = {k: event_dict.pop(k) for k in _FIRST if k in event_dict}
    return {**head, **event_dict}


def _json_formatter() -> logging.Formatter:
    return structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _event_first,
                    structlog.processors.JSONRenderer(sort_keys=False)],
        foreign_pre_chain=_SHARED,
    )


def _console_formatter(stream: TextIO) -> logging.Formatter:
    return structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.dev.ConsoleRenderer(colors=stream.isatty())],
        foreign_pre_chain=_SHARED,
    )


def _drop_closed_streams(root: logging.Logger) -> None:
    """A console handler whose stream was closed under it (an earlier caller's captured stdout,
    a closed pipe) can neither be re-formatted nor written to: it is removed, not kept."""
    for handler in list(root.handlers):
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.StreamHandler) and getattr(stream, "closed", False):
            root.removeHandler(handler)


class RunLogHandler(logging.FileHandler):
    """A process's log in the run dir, appended to as rundir.open_regular opens: a link or a
    special file planted at its path is refused (UnsafePath), never followed or blocked on."""

    def _open(self) -> io.TextIOWrapper:
        import os

        fd = open_regular(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return open(fd, "a", encoding=self.encoding or "utf-8", errors=self.errors)


def configure(run_dir: Optional[Path], role: str, console_level: int = logging.WARNING,
              keep_root_handlers: bool = False) -> structlog.stdlib.BoundLogger:
    """Route structlog through stdlib logging. `keep_root_handlers` keeps (and re-formats)
    Hydra's handlers; otherwise the root gets `<role>.log` (JSON) in run_dir and a console.
    The console shows `console_level` and above."""
    structlog.configure(
        processors=_SHARED + [structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    _drop_closed_streams(root)
    if keep_root_handlers and root.handlers:
        for handler in root.handlers:
            if isinstance(handler, logging.FileHandler):
                handler.setFormatter(_json_formatter())
            elif isinstance(handler, logging.StreamHandler):
                handler.setFormatter(_console_formatter(handler.stream))
                handler.setLevel(console_level)
                _quiet(handler, console_level)
    else:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        console = logging.StreamHandler(sys.stdout)
        console.setLevel(console_level)
        console.setFormatter(_console_formatter(sys.stdout))
        _quiet(console, console_level)
        root.addHandler(console)
        if run_dir is not None:
            fh = RunLogHandler(RunFiles(run_dir).log(role))
            fh.setFormatter(_json_formatter())
            root.addHandler(fh)
    root.setLevel(logging.INFO)
    logging.raiseExceptions = False  # a log handler on a full disk must not print tracebacks
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(role=role)
    return structlog.get_logger("orchestrator")


class DecisionLog:
    """decisions.jsonl: one JSON line per routing decision (event, timestamp, logger, role,
    then the decision's fields), a step's lines in one write, flushed to the file at most every
    FLUSH_S and at close (not a syscall per step). `static` holds the fields that every
    decision of this process shares (rendered once)."""

    FLUSH_S = 0.05  # lines reach the file at least this often (and at close), not per step

    def __init__(self, path: Path, role: str, static: dict):
        self.fh = RunFile(path, "w", buffering=1 << 16)
        self.role = json.dumps(role)
        self.static = json.dumps(static)[1:-1]
        self._flushed = time.monotonic()

    def write(self, decisions: list[dict]) -> None:
        self.write_fields([json.dumps(d)[1:-1] for d in decisions])

    def write_fields(self, fields: list[str]) -> None:
        """Decisions already rendered as JSON object members without braces (the hot path
        renders what a step's decisions share once)."""
        if not fields:
            return
        ts = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        head = (f'{{"event": "route_decision", "timestamp": "{ts}", '
                f'"logger": "orchestrator.decisions", "role": {self.role}, ')
        tail = f", {self.static}{self.fh.tag}}}\n"
        self.fh.write("".join([head + f + tail for f in fields]))
        now = time.monotonic()
        if now - self._flushed >= self.FLUSH_S:
            self.fh.flush()
            self._flushed = now

    def close(self) -> None:
        self.fh.close()


def _quiet(handler: logging.Handler, console_level: int) -> None:
    for f in [f for f in handler.filters if isinstance(f, _NotSummarized)]:
        handler.removeFilter(f)
    handler.addFilter(_NotSummarized(FILE_ONLY | SUMMARIZED if console_level > logging.INFO else FILE_ONLY))
