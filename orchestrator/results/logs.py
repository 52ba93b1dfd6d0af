"""structlog set-up: JSON lines in the run dir, a quiet console, decisions in their own file.

Called inside the task function and at the start of each endpoint process (spawned workers
and joblib/loky workers do not run module-level code of __main__). Hydra has already
configured the stdlib root logger in the task process (console + <job>.log); we keep its
handlers and give them structlog's ProcessorFormatter, so Hydra's file and ours are one. The
console shows the summary and `warning:` lines (one plain line per warning; the events that
repeat per request, COUNTED, are left out and counted on one line after the run by
`repeated_warnings`) unless `logging.console=true` (or Hydra's `hydra.verbose`) asks for every
structured line there too.

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

from orchestrator.results.escape import escape_event, printable
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
# Warnings that repeat (one per request or message): never one line each on the quiet console;
# the summary counts them from the run dir's logs (repeated_warnings). Value: what N of them are.
COUNTED = {"handoff_rejected": "handoffs rejected", "verdict_out_of_state": "verdicts out of state",
           "control_rejected": "control messages rejected", "control_dropped": "control messages dropped",
           "control_replayed": "control messages replayed", "bootstrap_rejected": "bootstrap lookups rejected"}


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


class _WarningLine(logging.Formatter):
    """The quiet console's form of a structured line: `warning: EVENT: DETAIL (REASON)`, one
    plain line (no timestamp, no key=value dump); `error:` for an error."""

    def format(self, record: logging.LogRecord) -> str:
        level = "warning" if record.levelno < logging.ERROR else "error"
        msg = record.msg
        if not isinstance(msg, dict):
            return f"{level}: {printable(' '.join(record.getMessage().split()))}"
        detail = msg.get("detail") or msg.get("error")
        reason = msg.get("reason")
        text = f"{level}: {msg.get('event')}" + (f": {detail}" if detail else "")
        if reason and reason != detail:
            text += f" ({reason})" if detail else f": {reason}"
        return printable(" ".join(text.split()))  # a peer's string among them: escaped


def _console_formatter(stream: TextIO, quiet: bool = False) -> logging.Formatter:
    if quiet:
        return _WarningLine()
    return structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, escape_event,
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
                handler.setFormatter(_console_formatter(handler.stream, quiet=console_level > logging.INFO))
                handler.setLevel(console_level)
                _quiet(handler, console_level)
    else:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        console = logging.StreamHandler(sys.stdout)
        console.setLevel(console_level)
        console.setFormatter(_console_formatter(sys.stdout, quiet=console_level > logging.INFO))
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
        self.write_groups([(fields, "")])

    def write_groups(self, groups: list[tuple[list[str], str]]) -> None:
        """write_fields of groups of decisions, in one write: each group's decisions (their
        own members) and the members they all end with (`shared`, rendered once: "" none)."""
        if not any(fields for fields, _ in groups):
            return
        ts = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        head = (f'{{"event": "route_decision", "timestamp": "{ts}", '
                f'"logger": "orchestrator.decisions", "role": {self.role}, ')
        out = []
        for fields, shared in groups:
            if fields:
                tail = f"{', ' if shared else ''}{shared}, {self.static}{self.fh.tag}}}\n"
                out.append(head + (tail + head).join(fields) + tail)
        self.fh.write("".join(out))
        now = time.monotonic()
        if now - self._flushed >= self.FLUSH_S:
            self.fh.flush()
            self._flushed = now

    def close(self) -> None:
        self.fh.close()


def _quiet(handler: logging.Handler, console_level: int) -> None:
    for f in [f for f in handler.filters if isinstance(f, _NotSummarized)]:
        handler.removeFilter(f)
    handler.addFilter(_NotSummarized(FILE_ONLY | SUMMARIZED | frozenset(COUNTED) if console_level > logging.INFO
                                     else FILE_ONLY))


def repeated_warnings(run_dir: Path) -> list[str]:
    """The COUNTED warnings of a run, read back from its processes' JSON logs: one line per
    event and detail, `19 handoffs rejected (room_never_landed): see decode.log`."""
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for path in sorted(Path(run_dir).glob("*.log")):
        if path.name.endswith((".stderr.log", ".mooncake.log")):
            continue
        try:
            with open(path, errors="replace") as fh:
                for line in fh:
                    if '"warning"' not in line or not any(f'"{e}"' in line for e in COUNTED):
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    event = rec.get("event")
                    if event in COUNTED and rec.get("level") == "warning":
                        detail = str(rec.get("detail") or rec.get("reason") or "")
                        files = counts.setdefault((event, detail), {})
                        seen = files.get(path.name, 0)  # `count`: a running count (rate-limited lines)
                        files[path.name] = max(seen, int(rec["count"])) if "count" in rec else seen + 1
        except OSError:
            continue
    return [f"{sum(files.values())} {COUNTED[event]}" + (f" ({detail})" if detail else "")
            + f": see {', '.join(files)}" for (event, detail), files in counts.items()]
