"""Run one handoff job: start every decode and prefill process at once (their engines come
up in parallel), hand the prefills the decode endpoints, watch, collect what they measured.

A `Job` holds one run: its processes, each behind a protocol.Channel, and its RunResult.
Every wait is bounded. A process that dies or stops reporting is ended, and its requests are
accounted for from what was recorded on disk (orchestrator.job.recovery): everything a decode
already judged keeps its verdict, the rest fail with a reason. Process faults are carried
out here when a prefill reaches the exact checkpoint the fault names. SIGINT and SIGTERM end
the run within about two seconds with what was measured so far. role=decode and
role=prefill meet through orchestrator.handoff.transport.bootstrap (the job's part: job.bootstrap).
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import structlog

from orchestrator.handoff.fault_kinds import divert_control, resume, strike
from orchestrator.handoff.transport.advert import Adverts, DecodeAdvert
from orchestrator.handoff.transport.bootstrap import lookup, serve_bootstrap
from orchestrator.job import protocol, warmstart
from orchestrator.job.bootstrap import DecodeWatch, start_metadata_server
from orchestrator.job.lifecycle import Interrupted, RunFailed, Signals, spawn
from orchestrator.job.mps import mps_for, record_servers
from orchestrator.job.recovery import decode_from_disk, reconstruct
from orchestrator.job.specs import JobSpecs
from orchestrator.profile.kinds import MpsMode, Role
from orchestrator.profile.plan import Device
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.outcomes import Detail
from orchestrator.results.records import RankResult, RunResult
from orchestrator.results.rundir import NoSpace, RunFiles, proc_name

if TYPE_CHECKING:
    from orchestrator.handoff.endpoints.prefill import Driver



def decode_main(*args: Any, **kwargs: Any) -> None:
    """The decode endpoint's entry (orchestrator.job.children). A child is started with its
    name (`entry`) and imports it there (warmstart.child_main): the parent needs neither torch
    nor Mooncake to run a job."""
    from orchestrator.job.children import decode_main as main

    main(*args, **kwargs)


def prefill_main(*args: Any, **kwargs: Any) -> None:
    """The prefill endpoint's entry (as decode_main)."""
    from orchestrator.job.children import prefill_main as main

    main(*args, **kwargs)


setattr(decode_main, "entry", "orchestrator.job.children:decode_main")  # noqa: B010
setattr(prefill_main, "entry", "orchestrator.job.children:prefill_main")  # noqa: B010


def _entry(fn: Callable[..., None]) -> str:
    """"module:function" a child imports and calls: an endpoint's own, or a test's stand-in."""
    return str(getattr(fn, "entry", f"{fn.__module__}:{fn.__qualname__}"))


STOP_GRACE_S = 1.0  # after an interrupt, a prefill's own result is awaited this long
# protocol refusals: the engine's last line is noise there
NOT_THE_ENGINE = ("LayoutMismatch", "refused", "MAC did not match")


class _Done(Exception):
    """The decode side's prefills all said bye."""


@dataclass
class _Proc:
    name: str
    proc: BaseProcess
    conn: protocol.Channel
    kind: str  # "prefill" | "decode"
    index: int  # prefill rank, or decode instance
    tp_rank: int = 0
    last_seen: float = 0.0
    done: bool = False
    running: bool = False  # a prefill that reached its handoff phase (it may hold records)
    t_start: float = 0.0  # when the runner started it
    progress_at: float = 0.0  # its last start-up progress (a Started phase, or the wait's start)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # start-up phase: when it ended


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _engine_log_tail(run_dir: Path, name: str) -> Optional[str]:
    path = RunFiles(run_dir).mooncake_log(name)
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _kill(p: _Proc) -> None:
    if p.proc.pid is not None:  # (started)
        resume(p.proc.pid)
    if p.proc.is_alive():
        p.proc.kill()
    p.proc.join(2)


def _send(p: _Proc, msg: protocol.ToChild) -> None:
    try:
        p.conn.send(msg)
    except (BrokenPipeError, OSError):
        pass


def _readable(conn: protocol.Channel) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return False


def _said(msg: protocol.ToRunner | protocol.ToChild, out: RunResult) -> str:
    """What an endpoint said that was not what the runner waited for: its error line (a
    full disk noted in `out`)."""
    return out.heard(msg.line) if isinstance(msg, protocol.Error) else repr(msg)


class _Progress(Protocol):
    """What run_handoffs reports to (orchestrator.results.progress.ProgressMeter, the bench's line;
    one with a `phase` method is told each driver phase's label too, one with `stage` and
    `tick` the runner's own stages and a beat from its loops)."""

    def start(self) -> None: ...

    def __call__(self, done: int, verified: Optional[int] = None) -> None: ...


def run_handoffs(specs: JobSpecs, run_dir: Path, progress: Optional[_Progress] = None,
                 driver: Optional[Driver] = None, bulk_bytes: int = 0, secret: Optional[bytes] = None,
                 signals: Optional[Signals] = None, after_watch: Optional[Callable[[], None]] = None) -> RunResult:
    """Start every decode process and every prefill rank of the job `specs` describes (job.
    specs.build_specs); run `driver` in the prefill ranks (default: the configured workload);
    watch them; return what they measured.
    `after_watch` is called when the handoffs ended, before the processes are wound down
    (app: the latency.png drawer starts then)."""
    job = Job(specs, run_dir, progress, driver, bulk_bytes, secret)
    job.after_watch = after_watch
    return job.run(signals)


class Job:
    """One handoff job: its specs (plan included), run dir and secret (the bootstrap's and the
    children's: each builds its own Authenticator from it), the processes it started (each
    behind a protocol.Channel) and its outcome, `out`."""

    def __init__(self, specs: JobSpecs, run_dir: Path,
                 progress: Optional[_Progress] = None, driver: Optional[Driver] = None, bulk_bytes: int = 0,
                 secret: Optional[bytes] = None) -> None:
        # workload.seed=null: drawn here for callers other than the CLI (which draws and records it)
        self.specs = specs = specs.seeded()  # what crosses into the children: built once, by the caller
        self.run_dir = run_dir
        self.progress, self.driver, self.bulk_bytes = progress, driver, bulk_bytes
        self.log = structlog.get_logger("orchestrator.runner")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.secret = secret if secret is not None else specs.secret
        self.out = RunResult()
        self.out.run_dir = str(run_dir)
        self.signals = Signals()
        self.decodes: list[_Proc] = []
        self.prefills: list[_Proc] = []
        self.t_spawn = _clock()
        self.stopped_at: Optional[float] = None  # the interrupt, as the watch saw it
        self.gone: set[int] = set()  # decode instances whose process the runner saw exit
        self.finished: dict[str, int] = Counter()  # per prefill, its requests done
        self.verified: dict[str, int] = Counter()  # per prefill, of those verified
        self._stage = getattr(progress, "stage", None)  # the progress line's phases and beat
        self._tick = getattr(progress, "tick", None)
        self.silent: Optional[socket.socket] = None  # the silent_control fault's listener
        self.metadata: Optional[subprocess.Popen[bytes]] = None  # the metadata server this run started
        self.after_watch: Optional[Callable[[], None]] = None  # called when the handoffs ended
        self.forkserver_wait_s = 0.0  # how long the children's start waited for the forkserver's imports

    def run(self, signals: Optional[Signals] = None) -> RunResult:
        """Start, watch and end every process; what they measured is `out`."""
        out = self.out
        if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
            # Inside a joblib/loky launcher worker the default start method is "loky"; spawned
            # children inherit that name and cannot resolve it. Endpoints always use spawn.
            mp.set_start_method("spawn", force=True)
        if self.specs.endpoints.decode_tp > 1:  # children inherit it: NVLink multicast (NVLS) stays off
            os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                              NVSHMEM_DISABLE_NVLS="1")
        sharing = self.specs.plan.sharing
        with (signals or self.signals) as self.signals, \
                mps_for(sharing, self.specs.report.plan.gpu_sharing, self.run_dir, self.log) \
                as out.gpu_sharing:
            try:
                if sharing.mode is MpsMode.on and not out.gpu_sharing["mps"]:
                    raise RunFailed(f"endpoints.mps=on: {out.gpu_sharing.get('error')}")
                self._run()
            except RunFailed as exc:
                out.error = str(exc)
                self.log.error("run_failed", error=out.error)
            except (Interrupted, _Done):
                pass
            finally:
                if self.signals.caught:
                    out.interrupted = self.signals.caught
                self._finish()
                self._close()
        if out.error and out.engine_log is None and not any(m in out.error for m in NOT_THE_ENGINE):
            for p in self.decodes + self.prefills:
                if p.name in (out.error or "") or not p.proc.is_alive():
                    out.engine_log = _engine_log_tail(self.run_dir, p.name) or out.engine_log
                    if out.engine_log:
                        break
        return out

    def _run(self) -> None:
        sp, out, role = self.specs, self.out, self.specs.role
        if self.signals.caught:
            raise Interrupted
        if sp.transport.mooncake.start_metadata_server:
            self.metadata = start_metadata_server(sp.transport.mooncake.metadata_server, self.run_dir)
        self._spawn()
        infos = self._startup()
        record_servers(out.gpu_sharing, sp.plan.sharing)  # (every process has its CUDA context now)
        if role is Role.decode:
            out.startup_s = round(_clock() - self.t_spawn, 3)
            self._phases()
            serve_bootstrap(sp.bootstrap, self.secret, infos, out, self.log, self.signals,
                            DecodeWatch(self.decodes, sp.bootstrap.prefill_ranks, out))
            raise Interrupted if self.signals.caught else _Done
        if role is Role.prefill:
            asked = lookup(sp.bootstrap, self.secret, self.signals, out, self.log)
            if asked is None:  # a signal ended the wait
                raise Interrupted
            infos = asked
        self.silent, applied = divert_control(sp.faults.kind, sp.transport.host, infos)
        out.faults_applied.extend(applied)
        for p in self.prefills:
            p.conn.send(protocol.Decodes(infos=infos))
        if self._stage is not None:
            self._stage("bootstrapping")
        self._await(self.prefills, sp.endpoints.startup_timeout_s, "while bootstrapping",
                    "did not bootstrap in time", self._on_running)
        out.startup_s = round(_clock() - self.t_spawn, 3)
        self._phases()
        out.t_phase = _clock()
        if self.progress is not None:
            self.progress.start()
        self._watch()
        if self.after_watch is not None and not self.signals.caught:
            self.after_watch()
        if self._stage is not None:
            self._stage("collecting results")

    def _close(self) -> None:
        if self.silent is not None:
            self.silent.close()
        if self.metadata is not None:
            self.metadata.terminate()
            self.metadata.wait(5)

    # ---- start ---------------------------------------------------------------------------
    def _start(self, name: str, kind: str, index: int, tp_rank: int, target: Callable[..., None],
               args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> _Proc:
        """A child running `target` (imported there by name: _entry) on its kind's spec, forked
        warm (warmstart) with this process's environment as it is now."""
        ctx = warmstart.context()
        conn, child = ctx.Pipe()
        spec = self.specs.prefill if kind == "prefill" else self.specs.decode
        proc = ctx.Process(target=warmstart.child_main, name=name, daemon=True, kwargs=kwargs or {},
                           args=(_entry(target), dict(os.environ), spec, str(self.run_dir), self.secret, child,
                                 *args))
        t_start = _clock()
        try:
            spawn(proc)
        except (EOFError, OSError) as exc:  # the forkserver died under it
            raise RunFailed(f"{name} could not be started: {type(exc).__name__}: {exc}") from None
        return _Proc(name, proc, protocol.Channel(conn), kind, index, tp_rank, t_start=t_start)

    def _spawn(self) -> None:
        """Every decode process, then every prefill rank; a decode TP group its rendezvous."""
        sp, e = self.specs, self.specs.endpoints
        if self._stage is not None:
            self._stage("starting processes")
        t0 = _clock()
        try:  # the forkserver's imports: a phase of their own, bounded as each child's are
            warmstart.wait_ready(e.startup_timeout_s, lambda: bool(self.signals.caught))
        except warmstart.NotReady as exc:
            raise RunFailed(f"{exc} (endpoints.startup_timeout_s={e.startup_timeout_s:g})") from None
        self.forkserver_wait_s = round(_clock() - t0, 3)
        if self.signals.caught:
            raise Interrupted
        for i in range(e.decode_ranks if sp.role is not Role.prefill else 0):
            for t in range(e.decode_tp):
                name = proc_name("decode", i, e.decode_ranks, t, e.decode_tp)
                self.decodes.append(self._start(name, "decode", i, t, decode_main, (i, t, self.bulk_bytes)))
        for r in range(e.prefill_ranks if sp.role is not Role.decode else 0):
            kwargs = {"rank": r} if self.driver is None else {"rank": r, "driver": self.driver}
            name = proc_name("prefill", r, e.prefill_ranks)
            self.prefills.append(self._start(name, "prefill", r, 0, prefill_main, kwargs=kwargs))
        if e.decode_tp > 1:
            backend = "nccl" if sp.plan.buffer_device is Device.cuda else "gloo"
            for i in range(e.decode_ranks):
                init = f"tcp://{sp.transport.host}:{_free_port(sp.transport.host)}"
                for p in self.decodes:
                    if p.index == i:
                        p.conn.send(protocol.Rendezvous(init_method=init, backend=backend))

    def _await(self, procs: list[_Proc], timeout_s: float, while_: str, late: str,
               take: Callable[[_Proc, Any], None]) -> None:
        """One message from each of `procs`, handed to `take` (which raises RunFailed on a
        wrong one). A process that exits first fails the run at once ("exited with code N
        `while_`"); one that makes no progress for `timeout_s` (no start-up phase ended:
        protocol.Started) fails it too ("NAMES `late`"). A process that reports its phases is
        not dead: `timeout_s` bounds each phase, not their sum."""
        now = _clock()
        pending = list(procs)
        for p in pending:
            p.progress_at = now
        while pending:
            if self.signals.caught:
                raise Interrupted
            if self._tick is not None:
                self._tick()
            self._decode_died(pending, while_)
            for p in list(pending):
                if p.conn.poll(0.02 / len(pending)):
                    try:
                        msg = p.conn.recv()
                    except (EOFError, OSError):  # it died: its pipe closed
                        p.proc.join(1.0)
                        raise RunFailed(f"{p.name} exited with code {p.proc.exitcode} {while_}") from None
                    if isinstance(msg, protocol.Started):
                        p.phases[msg.phase] = msg.at
                        p.progress_at = _clock()
                        continue
                    take(p, msg)
                    pending.remove(p)
                elif not p.proc.is_alive() and not p.conn.poll(0):
                    raise RunFailed(f"{p.name} exited with code {p.proc.exitcode} {while_}")
            now = _clock()
            stuck = [p for p in pending if now - p.progress_at > timeout_s]
            if stuck:
                raise RunFailed(f"{', '.join(p.name for p in stuck)} {late}")

    def _phases(self) -> None:
        """Each process's start-up, phase by phase (warmstart): seconds from the end of the
        previous phase (the first: from the runner's start of it) to the end of this one."""
        if warmstart.method() == "forkserver":  # what every child's start waited for, once
            self.out.startup_phases["forkserver"] = {"imports_left": self.forkserver_wait_s}
        for p in self.prefills + self.decodes:
            last, mine = p.t_start, {}
            for phase, at in sorted(p.phases.items(), key=lambda kv: kv[1]):
                mine[phase], last = round(max(0.0, at - last), 3), at
            self.out.startup_phases[p.name] = mine
        self.log.info("startup_phases", start_method=warmstart.method(), **self.out.startup_phases)

    def _decode_died(self, pending: list[_Proc], while_: str) -> None:
        """A decode that said it was ready and then exited, while the runner waits on others
        (the prefills' hello to it, say): named now, not blamed on a prefill whose hello then
        times out. Checked before the pending processes' messages."""
        for d in self.decodes:
            if d not in pending and d.proc.exitcode is not None and not (
                    d.proc.exitcode == 0 and self.signals.caught):
                why = f"exited with code {d.proc.exitcode}"
                self.out.lost.setdefault(d.name, why)
                self.out.t_stop = self.out.t_stop or _clock()
                self.log.error("process_lost", process=d.name, why=why)
                raise RunFailed(f"{d.name} {why} {while_}")

    def _startup(self) -> Adverts:
        """Every decode ready and every prefill's engine up (they come up together)."""
        e = self.specs.endpoints
        infos: dict[tuple[int, int], DecodeAdvert] = {}
        self._await(self.decodes + self.prefills, e.startup_timeout_s, "while starting",
                    f"did not start within endpoints.startup_timeout_s={e.startup_timeout_s:g}",
                    lambda p, msg: self._on_start(p, msg, infos))
        up = self.out.startup_by_process  # in a fixed order (prefills, then decodes), not as they came up
        self.out.startup_by_process = {p.name: up[p.name] for p in self.prefills + self.decodes if p.name in up}
        if not self.decodes:
            return []
        return [[infos[(i, t)] for t in range(e.decode_tp)] for i in range(e.decode_ranks)]

    def _on_start(self, p: _Proc, msg: protocol.ToRunner | protocol.ToChild,
                  infos: dict[tuple[int, int], DecodeAdvert]) -> None:
        out = self.out
        match msg:
            case protocol.Ready(info=info):
                out.startup_by_process[p.name] = round(_clock() - self.t_spawn, 3)
                infos[(p.index, p.tp_rank)] = info
                out.transports[p.name] = info.transport
                out.engine_exposed = sorted(set(out.engine_exposed) | set(info.engine_exposed))
                self.log.info("decode_ready", process=p.name, **info.log_fields())
            case protocol.Up(transport=transport):
                out.startup_by_process[p.name] = round(_clock() - self.t_spawn, 3)
                out.transports[p.name] = transport
            case _:
                raise RunFailed(f"{p.name} endpoint did not start: {_said(msg, out)}")

    def _on_running(self, p: _Proc, msg: protocol.ToRunner | protocol.ToChild) -> None:
        if not isinstance(msg, protocol.Running):
            raise RunFailed(f"{p.name} endpoint failed: {_said(msg, self.out)}")
        p.last_seen = _clock()
        p.running = True

    # ---- watch ---------------------------------------------------------------------------
    def _watch(self) -> None:
        """Until every prefill sent its result or is lost; after an interrupt, at most
        STOP_GRACE_S more."""
        while not all(p.done for p in self.prefills):
            if self._tick is not None:
                self._tick()
            if self.stopped_at is None and not self.signals.caught:  # (a group signal also ends the decodes)
                self._watch_decodes()
            if self.signals.caught and self.stopped_at is None:
                self.stopped_at = self.out.t_stop = _clock()
                self.log.warning("interrupted", signal=self.signals.caught)
                for p in self.prefills:
                    if not p.done:
                        _send(p, protocol.Stop())
            for p in self.prefills:
                if not p.done:
                    self._watch_prefill(p)
            if self.stopped_at is not None and _clock() - self.stopped_at > STOP_GRACE_S:
                for p in self.prefills:  # slow to stop is not lost: its records and the decodes' count
                    if not p.done:
                        p.done = True
                        self.out.slow_to_stop.append(p.name)
                        self.log.warning("slow_to_stop", process=p.name, grace_s=STOP_GRACE_S)
                        _kill(p)

    def _watch_prefill(self, p: _Proc) -> None:
        watchdog = self.specs.transport.timeout_s + 5.0  # a prefill reports four times a second
        if p.conn.poll(0.02 / len(self.prefills)):
            try:
                msg = p.conn.recv()
            except (EOFError, OSError):
                self._lose(p, "endpoint failed: its pipe closed")
                return
            p.last_seen = _clock()
            self._on_prefill(p, msg)
        elif not p.proc.is_alive() and not p.conn.poll(0):
            if self.stopped_at is not None:  # it ended after the interrupt: its records count
                p.done = True
                self.out.slow_to_stop.append(p.name)
            else:
                self._lose(p, f"exited with code {p.proc.exitcode}")
        elif self.stopped_at is None and _clock() - p.last_seen > watchdog:
            self._lose(p, f"sent nothing for {watchdog:g} s")

    def _on_prefill(self, p: _Proc, msg: protocol.ToRunner | protocol.ToChild) -> None:
        progress = self.progress
        match msg:
            case protocol.Progress(finished=n, verified=v):
                self.finished[p.name], self.verified[p.name] = n, v
                if progress is not None:
                    progress(sum(self.finished.values()), sum(self.verified.values()))
            case protocol.FaultReached(kind=kind):
                self._fault(p, kind)
            case protocol.Phase(label=label):  # a driver with several phases (the bench) began one
                if progress is not None and hasattr(progress, "phase"):
                    progress.phase(label)
            case protocol.Result(result=result):
                self.out.add(p.name, result)
                p.done = True
                if progress is not None and isinstance(result, RankResult):  # its final count
                    self.finished[p.name], self.verified[p.name] = result.finished, result.verified
                    progress(sum(self.finished.values()), sum(self.verified.values()))
            case _:
                self._lose(p, f"endpoint failed: {_said(msg, self.out)}")

    def _watch_decodes(self) -> None:
        """A decode process that exited is gone now, not after transport.timeout_s of silence:
        every prefill fails what it owes that instance at once (decode_lost) and goes on."""
        for d in self.decodes:
            if d.index in self.gone or d.proc.is_alive() or d.proc.exitcode == 0:
                continue  # (exit 0: it was told to stop, by a signal the runner sees too)
            self.gone.add(d.index)
            why = f"exited with code {d.proc.exitcode}"
            self.out.lost.setdefault(d.name, why)
            self.out.t_stop = self.out.t_stop or _clock()
            self.log.error("process_lost", process=d.name, why=why)
            for p in self.prefills:
                if not p.done:
                    _send(p, protocol.DecodeGone(index=d.index, why=f"{d.name} {why}"))

    def _lose(self, p: _Proc, why: str) -> None:
        p.done = True
        self.out.lost[p.name] = why
        self.out.t_stop = self.out.t_stop or _clock()
        self.log.error("process_lost", process=p.name, why=why)
        _kill(p)
        for d in self.decodes:  # it writes nothing more: its slots can go back
            _send(d, protocol.PrefillGone(rank=p.index))

    def _fault(self, p: _Proc, kind: str) -> None:
        """A prefill reached the fault's checkpoint: act (faults.strike), then let it go on."""
        f = self.specs.faults
        fault = {"fault": kind, "after_handoffs": f.at_request, "at": round(time.time(), 3)}
        self.out.faults_applied.append(fault)
        self.log.warning("fault_injected", **fault)
        decode_pid = self.decodes[0].proc.pid if self.decodes else None
        if strike(kind, p.proc.pid, decode_pid, f.duration_s):
            _send(p, protocol.FaultDone())

    # ---- finish --------------------------------------------------------------------------
    def _finish(self) -> None:
        """Stop the prefills and the decodes, collect their results, end every process, and
        account for every lost process's requests from what is on disk."""
        out = self.out
        for p in self.prefills:
            if not p.done and p.proc.is_alive():
                _send(p, protocol.Stop())
        if out.interrupted and out.t_stop is None:
            out.t_stop = _clock()
        deadline = _clock() + 1.0
        for p in self.prefills:  # one that never reached its handoff phase has no result to wait for
            if not p.done and (p.running or not out.interrupted):
                self._last_word(p, deadline, functools.partial(self._prefill_result, p))
        for d in self.decodes:
            if d.proc.is_alive():
                assert d.proc.pid is not None  # (alive)
                resume(d.proc.pid)  # in case a stop fault is still in force
                _send(d, protocol.Stop())
        ran = any(p.running for p in self.prefills) or not self.prefills
        deadline = _clock() + ((1.0 if ran else 0.3) if out.interrupted else 10.0)
        own: dict[str, str] = {}  # a decode's own last word: its error
        for d in self.decodes:
            self._last_word(d, deadline, functools.partial(self._decode_result, d, own=own))
        deadline = _clock() + (0.5 if not out.interrupted else 0.2)
        for p in self.prefills + self.decodes:
            p.proc.join(max(0.0, deadline - _clock()))
            _kill(p)
        self._account(own)

    def _last_word(self, p: _Proc, deadline: float, take: Callable[[Any], bool]) -> None:
        """Read `p`'s pipe until `take(msg)` says it was the last word, the pipe closes, or
        `deadline`. A process that already died may have said it before: its pipe is read too."""
        while (p.proc.is_alive() or _readable(p.conn)) and _clock() < deadline:
            if p.conn.poll(0.05):
                try:
                    msg = p.conn.recv()
                except (EOFError, OSError):
                    return
                if take(msg):
                    return

    def _prefill_result(self, p: _Proc, msg: protocol.ToRunner | protocol.ToChild) -> bool:
        if isinstance(msg, protocol.Result):
            self.out.add(p.name, msg.result)
            p.done = True
        return p.done

    def _decode_result(self, d: _Proc, msg: protocol.ToRunner | protocol.ToChild, own: dict[str, str]) -> bool:
        out = self.out
        match msg:
            case protocol.Stats(result=result):
                out.decodes[d.name] = result
            case protocol.Error(line=line):
                own[d.name] = out.heard(line)
                if out.error is None:
                    out.error = f"{d.name} endpoint failed: {line}"
                    out.engine_log = _engine_log_tail(self.run_dir, d.name)
            case _:
                return False
        return True

    def _account(self, own: dict[str, str]) -> None:
        """Every process that did not report, from disk; every decode a prefill declared lost."""
        out, ep = self.out, self.specs.endpoints
        report = self.specs.report  # what a rank that did not report is accounted from
        for d in self.decodes:
            if d.name not in out.decodes:
                out.decodes[d.name] = decode_from_disk(self.run_dir, d.name)
                if d.name in own:
                    out.decodes[d.name].error = f"{own[d.name]} (counts from its verdicts file)"
                if not out.interrupted and out.error is None and d.proc.exitcode not in (0, None):
                    out.lost.setdefault(d.name, f"exited with code {d.proc.exitcode}")
        for p in self.prefills:
            if not out.reported(p.name):
                reason = out.lost.get(p.name)
                full: list[NoSpace] = []
                out.ranks[p.name] = reconstruct(report, self.run_dir, p.index, p.name,
                                                Detail.interrupted if out.interrupted and not reason else
                                                Detail.prefill_lost if reason else Detail.run_error,
                                                route=self.specs.plan.route.value, ran=p.running,
                                                phase=(out.t_phase, out.t_stop), full=full)
                if full:  # the records kept their complete lines; the run says which file
                    out.no_space = out.no_space or str(full[0].path)
        for p in self.prefills:  # a decode a prefill declared lost (silent past transport.timeout_s)
            rank = out.ranks.get(p.name)  # none where a driver ran
            for inst, why in (rank.lost.items() if rank else ()):
                out.lost.setdefault(proc_name("decode", inst, ep.decode_ranks, 0, ep.decode_tp),
                                    f"declared lost by {p.name}: {why}")
