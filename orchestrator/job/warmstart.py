"""Children that start warm (issue 37): the endpoint processes are forked from a
multiprocessing forkserver that has already imported torch, zmq, numpy and the endpoint
modules, so a prefill or decode process pays none of that again (3 s each on a quiet 2-core
box, 20 s under load). The forkserver is started as soon as a job's config is checked
(`start_early`), and imports while the parent writes its plan, fingerprint and logs.

CUDA stays correct: the forkserver is a fresh interpreter (fork+exec of this Python, not a
fork of the parent, which may have asked torch about its GPUs), imports torch without
initialising CUDA, and every child creates its own CUDA context after the fork, as a spawned
child did. Mooncake's engine is imported in the child, after its MC_* environment is in
place (backends.mooncake.engine), as before.

A forked child inherits the forkserver's environment, not the parent's at the time it is
started: `child_main` puts the parent's environment (as it was at `Process.start`) in place
before anything of the endpoint runs, as spawn's exec did. SIGINT and SIGTERM are ignored in
the forkserver and so in each child until the child installs its own handlers
(endpoints.common.start_process), as lifecycle.spawn arranges for spawned ones.

Each child reports its start-up phases through its pipe (protocol.Started, sent by the
handoff's control.mark, which child_main points at the pipe):
interpreter (start to its first line of ours: with the forkserver, also the wait for its
imports while they are not done), imports (the endpoint module; 0 when preloaded), buffers,
engine (Mooncake up and the buffers registered), warm-up (the device's first-use costs),
waiting (for the other processes), bootstrap (the hello and the first write to every
decode). The runner keeps them per process (results.json startup_phases) and counts each one
as progress (endpoints.startup_timeout_s bounds a phase without progress).

ORCHESTRATOR_START_METHOD=spawn starts every child as a fresh interpreter instead (what
tools/startup_figures.py compares against)."""

from __future__ import annotations

import importlib
import os
import signal
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

# What the forkserver imports once for every child (each of these pulls in torch, zmq, numpy)
PRELOAD = ["orchestrator.job.forkserver_unblock",  # first: the mask start_early set, lifted
           "orchestrator.job.children",  # the endpoints' entries (they import both endpoints)
           "orchestrator.job.runner", "orchestrator.job.app", "hydra",
           "orchestrator.job.forkserver_ready"]  # last: says the imports are done
METHOD_ENV = "ORCHESTRATOR_START_METHOD"
READY_ENV = "ORCHESTRATOR_FORKSERVER_READY"

_lock = threading.Lock()
_ready: Optional[str] = None  # the file the forkserver creates when its imports are done
_ready_seen = False


class NotReady(Exception):
    """The forkserver exited, or made no progress within the bound: one line why."""


def method() -> str:
    """forkserver where the platform has it, unless ORCHESTRATOR_START_METHOD says spawn."""
    import multiprocessing as mp

    asked = os.environ.get(METHOD_ENV, "forkserver")
    return "forkserver" if asked == "forkserver" and "forkserver" in mp.get_all_start_methods() else "spawn"


def context() -> Any:
    """The multiprocessing context endpoints are started with (its forkserver running)."""
    import multiprocessing as mp

    name = method()
    if name == "forkserver":
        start_early()
    return mp.get_context(name)


def start_early() -> None:
    """Start the forkserver now (it imports PRELOAD in the background; the first child waits
    for that). Idempotent, cheap when it runs already: a fork and exec of this Python."""
    if method() != "forkserver":
        return
    import multiprocessing as mp
    from multiprocessing import forkserver

    global _ready, _ready_seen
    with _lock:
        before = getattr(forkserver._forkserver, "_forkserver_pid", None)
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
        sigs = (signal.SIGINT, signal.SIGTERM)
        main = threading.current_thread() is threading.main_thread()
        from multiprocessing import resource_tracker

        # the resource tracker first, outside the window: its own start unblocks SIGINT and
        # SIGTERM (multiprocessing.resource_tracker), which would open the window early
        resource_tracker.ensure_running()
        # blocked, never ignored, here: a signal that comes while the forkserver is forked and
        # exec'd stays pending and reaches this process's handler when the mask is restored
        # (setting SIG_IGN would discard it); the forkserver inherits the mask, ignores both and
        # lifts it as its first import (forkserver_unblock), so it and every child start with both
        # ignored (lifecycle.spawn) until a child installs its own handlers
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, sigs) if main else None
        ready = os.path.join(tempfile.gettempdir(), f".orchestrator-forkserver-{os.getpid()}-{time.time_ns()}")
        os.environ[READY_ENV] = ready
        try:
            _ensure_running(forkserver)
            if getattr(forkserver._forkserver, "_forkserver_pid", None) != before:  # a new one
                _ready, _ready_seen = ready, False
                import atexit

                atexit.register(_unready_ends, ready)  # (a command that ended before its first child)
        finally:
            os.environ.pop(READY_ENV, None)
            if mask is not None:  # last: a pending Ctrl-C is delivered here, the bookkeeping done
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _ensure_running(forkserver: Any) -> None:
    """The forkserver's fork and exec (a test replaces this to send a signal in the window)."""
    forkserver.ensure_running()


def _unready_ends(path: str) -> None:
    """At exit: a forkserver still importing for a run that never asked for a child (a
    refusal Hydra made after the checks, a Ctrl-C) is ended, not left importing torch after
    the command returned (it would exit by itself only once its imports are done)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if path == _ready and not _ready_seen and not os.path.exists(path) and pid is not None and _alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def wait_ready(timeout_s: float, stop: Any = lambda: False) -> None:
    """Wait until the forkserver's imports are done (they may take seconds under load);
    NotReady when it exits first, or `timeout_s` passes. `stop()` true: return at once."""
    global _ready_seen
    if _ready_seen or _ready is None or method() != "forkserver":
        return
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(_ready):
        if stop():
            return
        if pid is not None and not _alive(pid):
            raise NotReady("the forkserver (torch and the endpoints' imports for every child) exited "
                           "before its imports were done")
        if time.monotonic() > deadline:
            raise NotReady(f"the forkserver's imports (torch and the endpoints', for every child) took more "
                           f"than {timeout_s:g} s")
        time.sleep(0.01)
    _ready_seen = True
    _unlink(_ready)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not), without reaping it (multiprocessing does)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _adopt(env: dict[str, str]) -> None:
    """The parent's environment as it was at Process.start (a forked child has the
    forkserver's), as spawn's exec would have given it."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


def driver_main(target: str, env: dict[str, str], *args: Any) -> None:
    """A warm child for a driver that owns its pipe and its messages (the cost ladder's pairs):
    the parent's environment, then `target` ("module:function") called with `args`; no
    start-up marks."""
    _adopt(env)
    module, _, func = target.partition(":")
    getattr(importlib.import_module(module), func)(*args)


def child_main(target: str, env: dict[str, str], *args: Any, **kwargs: Any) -> None:
    """A child's entry: the parent's environment, then the endpoint `target`
    ("module:function") called with `args` (spec, run_dir, secret, conn, ...). The child's
    start-up marks (control.mark) go to its pipe from here on."""
    from orchestrator.handoff.endpoints import control
    from orchestrator.job import protocol

    _adopt(env)
    conn: Connection = args[3]
    control.marks_to(protocol.Channel(conn))
    control.mark("interpreter")
    module, _, func = target.partition(":")
    fn = getattr(importlib.import_module(module), func)
    control.mark("imports")
    fn(*args, **kwargs)
