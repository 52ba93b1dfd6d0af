"""Loaded by tools/call_trace.py (this folder first on PYTHONPATH): wraps the functions named
in $CALL_TRACE ("module:Qual.name,...") when their modules are imported, and records each
call's (function, thread, enter, exit) on CLOCK_MONOTONIC (time.perf_counter_ns: one clock for
every process of the host). Each process writes its calls to $CALL_TRACE_OUT/<pid>.json at exit
(atexit, os._exit and a fork's child included). Not imported by the project itself; while
it is first on the path it takes the place of any other sitecustomize."""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

_SPEC = [s.strip() for s in os.environ.get("CALL_TRACE", "").split(",") if s.strip()]
_OUT = os.environ.get("CALL_TRACE_OUT", "")
_WANT: dict[str, list[str]] = {}
_DUMPS: set[str] = set()  # "...!": the calls so far are written when one of these returns
for _s in _SPEC:
    _m, _, _q = _s.rstrip("!").partition(":")
    _WANT.setdefault(_m, []).append(_q)
    if _s.endswith("!"):
        _DUMPS.add(f"{_m}:{_q}")

_names: list[str] = []
_calls: list[tuple[int, int, int, int]] = []  # (function index, thread ident, enter ns, exit ns)
_pc = time.perf_counter_ns
_ident = threading.get_ident


def _wrap(fn, index: int, dumps: bool):
    append = _calls.append

    @functools.wraps(fn)
    def traced(*a, **kw):
        t0 = _pc()
        try:
            return fn(*a, **kw)
        finally:
            append((index, _ident(), t0, _pc()))
            if dumps:  # (a process the runner may kill before its exit)
                _dump(final=False)

    return traced


def _patch(module) -> None:
    for qual in _WANT.get(module.__name__, []):
        owner, parts = module, qual.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p, None)
            if owner is None:
                break
        if owner is None or not hasattr(owner, parts[-1]):
            print(f"call_trace: {module.__name__}:{qual} not found", file=sys.stderr)
            continue
        raw = owner.__dict__.get(parts[-1], getattr(owner, parts[-1]))
        if isinstance(raw, (staticmethod, classmethod)):
            print(f"call_trace: {qual} is a {type(raw).__name__}: not traced", file=sys.stderr)
            continue
        name = f"{module.__name__}:{qual}"
        _names.append(name)
        setattr(owner, parts[-1], _wrap(raw, len(_names) - 1, name in _DUMPS))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _WANT:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_written = False


def _dump(final: bool = True) -> None:
    global _written
    if _written or not _OUT or not _names or not _calls:
        return
    _written = final
    if os.environ.get("CALL_TRACE_DEBUG"):
        print(f"call_trace: {os.getpid()} writes {len(_calls)} calls", file=sys.stderr)
    try:
        cmd = open(f"/proc/{os.getpid()}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = ""
    path = os.path.join(_OUT, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as fh:  # renamed whole: a process killed mid-write leaves the last one
        json.dump({"pid": os.getpid(), "cmd": cmd, "names": _names, "calls": _calls}, fh)
    os.replace(path + ".tmp", path)


def _child() -> None:
    global _written, _calls
    _written = False
    del _calls[:]


if _WANT and _OUT:
    sys.meta_path.insert(0, _Finder())
    atexit.register(_dump)
    os.register_at_fork(after_in_child=_child)
    _exit = os._exit

    def _traced_exit(code: int) -> None:
        try:
            _dump()
        finally:
            _exit(code)

    os._exit = _traced_exit  # type: ignore[assignment]
