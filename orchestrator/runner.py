"""Run one handoff job: start decode, then prefill, as two spawned processes; watch them;
collect what they measured. Every wait is bounded: a process that stops reporting is killed
and its requests are counted as failed. Process-level faults (faults.kind) are applied here."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import structlog

from .config import FaultKind, OrchestratorConfig
from .endpoints.decode import decode_main
from .endpoints.prefill import prefill_main
from .faults import silent_listener
from .plan import Plan


class RunFailed(RuntimeError):
    """An endpoint could not start or run; the message says which and why."""


@dataclass
class RunOutput:
    tally: dict[str, Any] = field(default_factory=dict)  # what the prefill driver returned
    wall_s: float = 0.0
    row_bytes: int = 0
    transports: dict[str, str] = field(default_factory=dict)
    decode_stats: dict[str, Any] = field(default_factory=dict)
    faults_applied: list[dict] = field(default_factory=list)
    engine_exposed: list[str] = field(default_factory=list)  # decode engine listeners off loopback
    error: Optional[str] = None


def _wait(conn, timeout_s: float, proc: mp.Process) -> tuple[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            return conn.recv()
        if not proc.is_alive() and not conn.poll(0):
            return "error", f"{proc.name} exited with code {proc.exitcode}"
    return "error", f"{proc.name} sent nothing for {timeout_s:g} s"


def _stop(proc: mp.Process, grace_s: float = 5.0) -> None:
    proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(2)


class ProcessFault:
    """decode_killed / decode_stopped: act on the decode process once `at_request` handoffs
    are done (checked at each progress report, about once a second)."""

    def __init__(self, cfg: OrchestratorConfig, decode: mp.Process, out: RunOutput, log):
        self.f, self.decode, self.out, self.log = cfg.faults, decode, out, log
        self.fired = False

    def __call__(self, done: int) -> None:
        if self.fired or done < self.f.at_request:
            return
        self.fired = True
        pid = self.decode.pid
        t = time.time()
        if self.f.kind is FaultKind.decode_killed:
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(self.f.duration_s, self._resume, args=(pid,)).start()
        self.out.faults_applied.append({"fault": self.f.kind.value, "after_handoffs": done,
                                        "at": round(t, 3)})
        self.log.warning("fault_injected", fault=self.f.kind.value, after_handoffs=done)

    @staticmethod
    def _resume(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def run_handoffs(cfg: OrchestratorConfig, plan: Plan, run_dir: Path,
                 progress=None, driver=None, bulk_bytes: int = 0) -> RunOutput:
    """Start decode, then prefill (running `driver`, default: the configured workload)."""
    log = structlog.get_logger("orchestrator.runner")
    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        # Inside a joblib/loky launcher worker the default start method is "loky"; spawned
        # children inherit that name and cannot resolve it. Endpoints always use spawn.
        mp.set_start_method("spawn", force=True)
    ctx = mp.get_context("spawn")
    out = RunOutput()
    startup = cfg.endpoints.startup_timeout_s
    watchdog = cfg.transport.timeout_s + 5.0  # prefill reports about four times a second

    d_conn, d_child = ctx.Pipe()
    decode = ctx.Process(target=decode_main, name="decode",
                         args=(cfg, plan, str(run_dir), d_child, bulk_bytes), daemon=True)
    decode.start()
    prefill = None
    silent = None
    fault = ProcessFault(cfg, decode, out, log) if cfg.faults.kind in (
        FaultKind.decode_killed, FaultKind.decode_stopped) else None
    try:
        kind, info = _wait(d_conn, startup, decode)
        if kind != "ready":
            raise RunFailed(f"decode endpoint did not start: {info}")
        out.transports["decode"] = info["transport"]
        out.engine_exposed = info.get("engine_exposed", [])
        log.info("decode_ready", **info)
        if cfg.faults.kind is FaultKind.silent_control:
            silent = silent_listener(cfg.transport.host)
            info = {**info, "control_endpoint": "tcp://%s:%d" % silent.getsockname()}
            out.faults_applied.append({"fault": "silent_control", "control_endpoint": info["control_endpoint"]})

        p_conn, p_child = ctx.Pipe()
        kwargs = {"driver": driver} if driver is not None else {}
        prefill = ctx.Process(target=prefill_main, name="prefill",
                              args=(cfg, plan, str(run_dir), info, p_child), kwargs=kwargs,
                              daemon=True)
        prefill.start()
        kind, value = _wait(p_conn, startup, prefill)
        if kind != "transport":
            raise RunFailed(f"prefill endpoint did not start: {value}")
        out.transports["prefill"] = value
        while True:
            kind, value = _wait(p_conn, watchdog, prefill)
            if kind == "progress":
                if fault:
                    fault(value)
                if progress:
                    progress(value)
                continue
            if kind == "result":
                out.wall_s = value.pop("wall_s", 0.0)
                out.row_bytes = value.pop("row_bytes", 0)
                out.tally = value
                break
            raise RunFailed(f"prefill endpoint failed: {value}")
    except RunFailed as exc:
        out.error = str(exc)
        log.error("run_failed", error=out.error)
    finally:
        if decode.is_alive():
            try:
                os.kill(decode.pid, signal.SIGCONT)  # in case a stop fault is still in force
                d_conn.send("stop")
                kind, value = _wait(d_conn, 10.0, decode)
                if kind == "stats":
                    out.decode_stats = value
                elif kind == "error" and out.error is None:
                    out.error = f"decode endpoint failed: {value}"
            except (BrokenPipeError, EOFError, OSError):
                pass
        for proc in (prefill, decode):
            if proc is not None:
                _stop(proc)
        if silent is not None:
            silent.close()
    return out
