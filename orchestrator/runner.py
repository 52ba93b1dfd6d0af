"""Run one handoff job: start decode, then prefill, as two spawned processes; watch them;
collect what they measured. Every wait is bounded: a process that stops reporting is killed
and its requests are counted as failed. Process-level faults (faults.kind) are applied here."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import structlog

from .config import FaultKind, OrchestratorConfig
from .endpoints.common import role_name
from .endpoints.decode import decode_main
from .endpoints.prefill import prefill_main
from .faults import silent_listener
from .plan import Plan
from .stats import LatencyHistogram


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


def merge_tallies(results: list[dict]) -> dict[str, Any]:
    """One tally from several prefill ranks: counters summed, latency arrays concatenated,
    per-pair stats keyed "p<prefill>->d<decode>", memory per rank."""
    if len(results) == 1:
        only = dict(results[0])
        only["pairs"] = {f"p0->d{j}": v for j, v in only.get("pairs", {}).items()}
        return only
    latency = ("send_us", "deliver_us", "handoff_us")
    merged: dict[str, Any] = {"outcomes": Counter(), "routes": Counter(), "reasons": Counter(),
                              "pairs": {}, "memory": {}, "rejected_auth": 0,
                              **{key: LatencyHistogram() for key in latency}}
    for r, res in enumerate(results):
        for key in ("outcomes", "routes", "reasons"):
            merged[key].update(res.get(key, {}))
        for key in latency:
            merged[key].merge(LatencyHistogram.from_dict(res.get(key)))
        for j, pair in res.get("pairs", {}).items():
            merged["pairs"][f"p{r}->d{j}"] = {**pair, "wall_s": res.get("wall_s")}
        merged["memory"][f"prefill{r}"] = res.get("memory", {})
        merged["rejected_auth"] += res.get("rejected_auth", 0)
    for key in ("outcomes", "routes", "reasons"):
        merged[key] = dict(merged[key])
    for key in latency:
        merged[key] = merged[key].to_dict()
    return merged


def run_handoffs(cfg: OrchestratorConfig, plan: Plan, run_dir: Path,
                 progress=None, driver=None, bulk_bytes: int = 0) -> RunOutput:
    """Start every decode rank, then every prefill rank (each running `driver`, default: the
    configured workload, handing off to all decode ranks); watch them; merge what they report."""
    log = structlog.get_logger("orchestrator.runner")
    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        # Inside a joblib/loky launcher worker the default start method is "loky"; spawned
        # children inherit that name and cannot resolve it. Endpoints always use spawn.
        mp.set_start_method("spawn", force=True)
    ctx = mp.get_context("spawn")
    run_dir.mkdir(parents=True, exist_ok=True)
    out = RunOutput()
    startup = cfg.endpoints.startup_timeout_s
    watchdog = cfg.transport.timeout_s + 5.0  # prefill reports about four times a second
    n_decode, n_prefill = cfg.endpoints.decode_ranks, cfg.endpoints.prefill_ranks

    decodes: list[tuple[mp.Process, Any]] = []
    for j in range(n_decode):
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=decode_main, name=role_name("decode", j, n_decode),
                           args=(cfg, plan, str(run_dir), child, bulk_bytes, j), daemon=True)
        proc.start()
        decodes.append((proc, conn))
    prefills: list[tuple[mp.Process, Any]] = []
    silent = None
    fault = ProcessFault(cfg, decodes[0][0], out, log) if cfg.faults.kind in (
        FaultKind.decode_killed, FaultKind.decode_stopped) else None
    try:
        infos = []
        for proc, conn in decodes:
            kind, info = _wait(conn, startup, proc)
            if kind != "ready":
                raise RunFailed(f"{proc.name} endpoint did not start: {info}")
            out.transports[proc.name] = info["transport"]
            out.engine_exposed = sorted(set(out.engine_exposed) | set(info.get("engine_exposed", [])))
            log.info("decode_ready", rank=proc.name, **info)
            infos.append(info)
        if cfg.faults.kind is FaultKind.silent_control:
            silent = silent_listener(cfg.transport.host)
            infos[0] = {**infos[0], "control_endpoint": "tcp://%s:%d" % silent.getsockname()}
            out.faults_applied.append({"fault": "silent_control",
                                       "control_endpoint": infos[0]["control_endpoint"]})

        kwargs = {"driver": driver} if driver is not None else {}
        for r in range(n_prefill):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=prefill_main, name=role_name("prefill", r, n_prefill),
                               args=(cfg, plan, str(run_dir), infos, child),
                               kwargs={**kwargs, "rank": r}, daemon=True)
            proc.start()
            prefills.append((proc, conn))
        for proc, conn in prefills:
            kind, value = _wait(conn, startup, proc)
            if kind != "transport":
                raise RunFailed(f"{proc.name} endpoint did not start: {value}")
            out.transports[proc.name] = value
        results: dict[int, dict] = {}
        done = [0] * n_prefill
        last_seen = [time.monotonic()] * n_prefill
        while len(results) < n_prefill:
            for r, (proc, conn) in enumerate(prefills):
                if r in results:
                    continue
                if conn.poll(0.05 / n_prefill):
                    kind, value = conn.recv()
                    last_seen[r] = time.monotonic()
                    if kind == "progress":
                        done[r] = value
                        total = sum(done)
                        if fault:
                            fault(total)
                        if progress:
                            progress(total)
                    elif kind == "result":
                        results[r] = value
                    else:
                        raise RunFailed(f"{proc.name} endpoint failed: {value}")
                elif not proc.is_alive() and not conn.poll(0):
                    raise RunFailed(f"{proc.name} exited with code {proc.exitcode}")
                elif time.monotonic() - last_seen[r] > watchdog:
                    raise RunFailed(f"{proc.name} sent nothing for {watchdog:g} s")
        ordered = [results[r] for r in range(n_prefill)]
        out.wall_s = max(res.pop("wall_s", 0.0) for res in ordered)
        out.row_bytes = ordered[0].pop("row_bytes", 0)
        out.tally = merge_tallies(ordered)
    except RunFailed as exc:
        out.error = str(exc)
        log.error("run_failed", error=out.error)
    finally:
        for j, (proc, conn) in enumerate(decodes):
            if not proc.is_alive():
                continue
            try:
                os.kill(proc.pid, signal.SIGCONT)  # in case a stop fault is still in force
                conn.send("stop")
                kind, value = _wait(conn, 10.0, proc)
                if kind == "stats":
                    out.decode_stats = value if n_decode == 1 else {
                        **out.decode_stats, proc.name: value}
                elif kind == "error" and out.error is None:
                    out.error = f"{proc.name} endpoint failed: {value}"
            except (BrokenPipeError, EOFError, OSError):
                pass
        for proc, _ in prefills + decodes:
            _stop(proc)
        if silent is not None:
            silent.close()
    return out
