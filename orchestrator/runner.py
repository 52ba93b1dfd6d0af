"""Run one handoff job: start every decode and prefill process at once (their engines come
up in parallel), hand the prefills the decode endpoints, watch, collect what they measured.

Every wait is bounded. A process that dies or stops reporting is ended, and its requests are
accounted for from what was recorded on disk: everything a decode already judged keeps its
verdict, the rest fail with a reason (orchestrator.results.read_records, verdicts-*.jsonl).
Process faults are carried out here when a prefill reaches the exact checkpoint the fault
names. SIGINT and SIGTERM end the run within about two seconds with what was measured so far.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import structlog

from .auth import run_secret
from .config import ConfigError, FaultKind, OrchestratorConfig, Role, resolve_seed
from .endpoints.common import proc_name
from .endpoints.decode import decode_main
from .endpoints.prefill import prefill_main
from .faults import silent_listener
from .outcomes import Detail, Outcome
from .plan import Device, Plan
from .lifecycle import Interrupted, RunFailed, Signals, spawn
from .results import DecodeResult, RankResult, Record, RunResult, read_records

_clock = time.monotonic


class _Done(Exception):
    """The decode side's prefills all said bye."""


@dataclass
class _Proc:
    name: str
    proc: mp.Process
    conn: Any
    kind: str  # "prefill" | "decode"
    index: int  # prefill rank, or decode instance
    tp_rank: int = 0
    last_seen: float = 0.0
    done: bool = False
    running: bool = False  # a prefill that reached its handoff phase (it may hold records)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _engine_log_tail(run_dir: Path, name: str) -> Optional[str]:
    path = run_dir / f"{name}.mooncake.log"
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _kill(p: _Proc) -> None:
    try:
        os.kill(p.proc.pid, signal.SIGCONT)
    except (ProcessLookupError, TypeError):
        pass
    if p.proc.is_alive():
        p.proc.kill()
    p.proc.join(2)


def run_handoffs(cfg: OrchestratorConfig, plan: Plan, run_dir: Path, progress: Optional[Callable] = None,
                 driver=None, bulk_bytes: int = 0, secret: Optional[bytes] = None,
                 signals: Optional[Signals] = None) -> RunResult:
    """Start every decode process and every prefill rank; run `driver` in the prefill ranks
    (default: the configured workload); watch them; return what they measured."""
    log = structlog.get_logger("orchestrator.runner")
    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        # Inside a joblib/loky launcher worker the default start method is "loky"; spawned
        # children inherit that name and cannot resolve it. Endpoints always use spawn.
        mp.set_start_method("spawn", force=True)
    ctx = mp.get_context("spawn")
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = secret if secret is not None else run_secret(cfg.transport.secret_env)
    resolve_seed(cfg)  # callers other than the CLI (which records it) get one too
    out = RunResult()
    out.run_dir = str(run_dir)
    e = cfg.endpoints
    t_spawn = _clock()
    decodes: list[_Proc] = []
    prefills: list[_Proc] = []
    silent = None
    role = cfg.role
    if e.decode_tp > 1:  # children inherit it: NVLink multicast (NVLS) stays off in NCCL
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    metadata = None
    with (signals or Signals()) as signals:
        try:
            if signals.caught:
                raise Interrupted
            if cfg.transport.mooncake.start_metadata_server:
                metadata = start_metadata_server(cfg.transport.mooncake.metadata_server, run_dir)
            for i in range(e.decode_ranks if role is not Role.prefill else 0):
                for t in range(e.decode_tp):
                    conn, child = ctx.Pipe()
                    name = proc_name("decode", i, e.decode_ranks, t, e.decode_tp)
                    proc = ctx.Process(target=decode_main, name=name, daemon=True,
                                       args=(cfg, plan, str(run_dir), secret, child, i, t, bulk_bytes))
                    spawn(proc)
                    decodes.append(_Proc(name, proc, conn, "decode", i, t))
            for r in range(e.prefill_ranks if role is not Role.decode else 0):
                conn, child = ctx.Pipe()
                name = proc_name("prefill", r, e.prefill_ranks)
                kwargs = {"rank": r} if driver is None else {"rank": r, "driver": driver}
                proc = ctx.Process(target=prefill_main, name=name, daemon=True,
                                   args=(cfg, plan, str(run_dir), secret, child), kwargs=kwargs)
                spawn(proc)
                prefills.append(_Proc(name, proc, conn, "prefill", r))
            if e.decode_tp > 1:
                backend = "nccl" if plan.buffer_device is Device.cuda else "gloo"
                for i in range(e.decode_ranks):
                    init = f"tcp://{cfg.transport.host}:{_free_port(cfg.transport.host)}"
                    for p in decodes:
                        if p.index == i:
                            p.conn.send(("rendezvous", {"init_method": init, "backend": backend}))
            infos = _startup(cfg, decodes, prefills, out, log, signals, t_spawn)
            if role is Role.decode:
                out.startup_s = round(_clock() - t_spawn, 3)
                _serve_bootstrap(cfg, secret, infos, decodes, out, log, signals)
                raise Interrupted if signals.caught else _Done
            if role is Role.prefill:
                infos = lookup(cfg, secret, signals)
            if cfg.faults.kind is FaultKind.silent_control:
                silent = silent_listener(cfg.transport.host)
                infos[0][0] = {**infos[0][0], "control_endpoint": "tcp://%s:%d" % silent.getsockname()}
                out.faults_applied.append({"fault": "silent_control",
                                           "control_endpoint": infos[0][0]["control_endpoint"]})
            for p in prefills:
                p.conn.send(("decodes", infos))
            _wait_all(prefills, "running", cfg.endpoints.startup_timeout_s, out, signals)
            out.startup_s = round(_clock() - t_spawn, 3)
            out.t_phase = _clock()
            if progress is not None:
                progress.start()
            _watch(cfg, prefills, decodes, out, log, progress, signals)
        except RunFailed as exc:
            out.error = str(exc)
            log.error("run_failed", error=out.error)
        except (Interrupted, _Done):
            pass
        finally:
            if signals.caught:
                out.interrupted = signals.caught
            _finish(cfg, run_dir, prefills, decodes, out, log, plan.route.value)
            if silent is not None:
                silent.close()
            if metadata is not None:
                metadata.terminate()
                metadata.wait(5)
    not_the_engine = ("LayoutMismatch", "refused", "MAC did not match")  # protocol refusals: the engine's last line is noise
    if out.error and out.engine_log is None and not any(m in out.error for m in not_the_engine):
        for p in decodes + prefills:
            if p.name in (out.error or "") or not p.proc.is_alive():
                out.engine_log = _engine_log_tail(run_dir, p.name) or out.engine_log
                if out.engine_log:
                    break
    return out


def _startup(cfg, decodes, prefills, out: RunResult, log, signals, t_spawn: Optional[float] = None
             ) -> list[list[dict]]:
    """Every decode ready and every prefill's engine up (they come up together)."""
    deadline = _clock() + cfg.endpoints.startup_timeout_s
    infos: dict[tuple[int, int], dict] = {}
    pending = {p.name: p for p in decodes + prefills}
    while pending:
        if signals.caught:
            raise Interrupted
        for name, p in list(pending.items()):
            if p.conn.poll(0.02):
                try:
                    kind, value = p.conn.recv()
                except (EOFError, OSError):  # it died while starting: its pipe closed
                    p.proc.join(1.0)
                    raise RunFailed(f"{p.name} exited with code {p.proc.exitcode} while starting") from None
                if kind in ("ready", "up") and t_spawn is not None:
                    out.startup_by_process[p.name] = round(_clock() - t_spawn, 3)
                if kind == "ready":
                    infos[(p.index, p.tp_rank)] = value
                    out.transports[p.name] = value["transport"]
                    out.engine_exposed = sorted(set(out.engine_exposed) | set(value.get("engine_exposed", [])))
                    log.info("decode_ready", process=p.name, **value)
                elif kind == "up":
                    out.transports[p.name] = value["transport"]
                else:
                    raise RunFailed(f"{p.name} endpoint did not start: {value}")
                del pending[name]
            elif not p.proc.is_alive() and not p.conn.poll(0):
                raise RunFailed(f"{p.name} exited with code {p.proc.exitcode} while starting")
        if _clock() > deadline:
            raise RunFailed(f"{', '.join(pending)} did not start within endpoints.startup_timeout_s="
                            f"{cfg.endpoints.startup_timeout_s:g}")
    e = cfg.endpoints
    if not decodes:
        return []
    return [[infos[(i, t)] for t in range(e.decode_tp)] for i in range(e.decode_ranks)]


def _public(info: dict) -> dict:
    return {k: info.get(k) for k in ("control_endpoint", "data_endpoint", "transport", "session_id")}


def _serve_bootstrap(cfg: OrchestratorConfig, secret: bytes, infos, decodes, out: RunResult, log,
                     signals) -> None:
    """role=decode: serve the decode endpoints at transport.host:transport.bootstrap_port to
    authenticated prefill sides, until every prefill rank said bye to every instance."""
    import zmq

    from . import wire
    from .auth import Authenticator

    auth = Authenticator(secret)
    host, want = cfg.transport.host, cfg.endpoints.prefill_ranks
    zctx = zmq.Context()
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.CONTROL_FRAME_BYTES)
    if cfg.transport.bootstrap_port:
        sock.bind(f"tcp://{host}:{cfg.transport.bootstrap_port}")
        port = cfg.transport.bootstrap_port
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    out.bootstrap = f"{host}:{port}"
    record = json.dumps({"address": out.bootstrap}) + "\n"
    (Path(out.run_dir) / "bootstrap.json").write_text(record)
    if cfg.transport.bootstrap_file:
        from .results import write_atomic

        write_atomic(Path(cfg.transport.bootstrap_file), record)
    print(f"decode side up: bootstrap address {out.bootstrap} (start the prefill side with "
          f"role=prefill peer={out.bootstrap})", flush=True)
    log.info("bootstrap_listening", address=out.bootstrap)
    reply = wire.encode("decodes", infos=[[_public(i) for i in inst] for inst in infos], prefill_ranks=want)
    byes: dict[int, set[int]] = {}
    leaders = [d for d in decodes if d.tp_rank == 0]
    wait_s = cfg.endpoints.startup_timeout_s
    deadline, answered = _clock() + wait_s, False
    rejected, quiet_until = 0, 0.0
    try:
        while not signals.caught:
            if not answered and _clock() > deadline:
                raise RunFailed(f"no prefill side looked up {out.bootstrap} within "
                                f"endpoints.startup_timeout_s={wait_s:g} (started with role=prefill "
                                f"peer={out.bootstrap} and the same transport.secret_env?)")
            if sock.poll(20):
                frames = sock.recv_multipart()
                body = auth.unseal(frames[1]) if len(frames) == 2 else None
                try:
                    msg = wire.decode(body) if body is not None else None
                except wire.WireError:
                    msg = None
                if msg is None and not answered and len(frames) == 2 and _unauthentic_lookup(frames[1]):
                    # a lookup in our format whose MAC does not match: the other side has
                    # another secret. Both sides stop now, not at endpoints.startup_timeout_s:
                    # it gets a sealed refusal it cannot open (and says so), this side ends.
                    sock.send_multipart([frames[0], auth.seal(wire.encode("error", detail="bad MAC"))])
                    raise RunFailed(secret_mismatch(cfg))
                if msg is None or msg["type"] != "lookup":
                    rejected += 1
                    if _clock() >= quiet_until:  # rate-limited: one line per 5 s, with the count
                        log.warning("bootstrap_rejected", reason="not an authentic lookup", count=rejected)
                        quiet_until = _clock() + 5.0
                elif msg["prefill_ranks"] != want:
                    sock.send_multipart([frames[0], auth.seal(wire.encode(
                        "error", detail=f"this decode side expects endpoints.prefill_ranks={want}, "
                                        f"the prefill side has {msg['prefill_ranks']}"))])
                else:
                    sock.send_multipart([frames[0], auth.seal(reply)])
                    answered = True
            for d in decodes:
                while d.conn.poll(0):
                    try:
                        kind, value = d.conn.recv()
                    except (EOFError, OSError):
                        raise RunFailed(f"{d.name} closed its pipe") from None
                    if kind == "bye" and d in leaders:
                        byes.setdefault(d.index, set()).add(value)
                    elif kind in ("refused", "prefill_lost") and d in leaders:
                        prank, why = value  # that prefill rank is done here, and failed
                        byes.setdefault(d.index, set()).add(prank)
                        name = proc_name("prefill", prank, want)
                        if kind == "refused":
                            out.error = out.error or f"{name} refused at bootstrap: {why}"
                        else:
                            out.lost.setdefault(name, why)
                    elif kind == "error":
                        raise RunFailed(f"{d.name} endpoint failed: {value}")
                if not d.proc.is_alive():
                    raise RunFailed(f"{d.name} exited with code {d.proc.exitcode}")
            if leaders and all(len(byes.get(d.index, ())) >= want for d in leaders):
                out.prefills_seen = sorted(set().union(*byes.values()))
                return
    finally:
        sock.close(0)
        zctx.term()
        if cfg.transport.bootstrap_file:  # a stale address must not send the next prefill here
            try:
                path = Path(cfg.transport.bootstrap_file)
                if path.read_text() == record:
                    path.unlink()
            except OSError:
                pass


def secret_mismatch(cfg: OrchestratorConfig) -> str:
    var = cfg.transport.secret_env
    return (f"the peer's MAC did not match: the two sides have different secrets in ${var} "
            f"(transport.secret_env={var})" if var else
            "the peer's MAC did not match: set the same transport.secret_env on both sides")


def _unauthentic_lookup(frame: bytes) -> bool:
    """A frame that reads as our lookup message but whose MAC failed (read, never acted on)."""
    from . import wire
    from .auth import MAC_BYTES

    try:
        return wire.decode(frame[:-MAC_BYTES])["type"] == "lookup"
    except (wire.WireError, KeyError, TypeError, ValueError):
        return False


def lookup(cfg: OrchestratorConfig, secret: bytes, signals) -> list[list[dict]]:
    """role=prefill: the decode endpoints, from the decode side's bootstrap address (asked
    again every second until endpoints.startup_timeout_s: that side may start later)."""
    import zmq

    from . import wire
    from .auth import Authenticator
    from .config import peer_address

    auth = Authenticator(secret)
    deadline = _clock() + cfg.endpoints.startup_timeout_s
    try:
        host, port = peer_address(cfg, cfg.endpoints.startup_timeout_s)
    except ConfigError as exc:
        raise RunFailed(str(exc)) from None
    zctx = zmq.Context()
    try:
        while _clock() < deadline and not signals.caught:
            if cfg.peer is None:  # a decode side restarted meanwhile writes a new address
                try:
                    host, port = peer_address(cfg)
                except ConfigError:
                    pass
            sock = zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, wire.CONTROL_FRAME_BYTES)
            sock.connect(f"tcp://{host}:{port}")
            sock.send(auth.seal(wire.encode("lookup", rank=0, prefill_ranks=cfg.endpoints.prefill_ranks)))
            got = sock.poll(1000)
            frame = sock.recv() if got else None
            sock.close(0)
            if frame is None:
                continue
            body = auth.unseal(frame)
            if body is None:
                raise RunFailed(f"{secret_mismatch(cfg)} (the decode side at {host}:{port})")
            msg = wire.decode(body)
            if msg["type"] == "error":
                raise RunFailed(f"the decode side at {host}:{port} refused: {msg['detail']}")
            return msg["infos"]
        if signals.caught:
            raise Interrupted
        raise RunFailed(f"no decode side answered at {host}:{port} within endpoints.startup_timeout_s="
                        f"{cfg.endpoints.startup_timeout_s:g} (is it up, with the same transport.secret_env?)")
    finally:
        zctx.term()


def start_metadata_server(url: str, run_dir: Path):
    """Mooncake's own HTTP metadata server (mooncake_http_metadata_server, in the wheel) for
    an http://HOST:PORT/metadata address on this host; returns the process."""
    import subprocess
    import sys
    from urllib.parse import urlsplit

    u = urlsplit(url)
    log = open(run_dir / "metadata_server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "mooncake.http_metadata_server", "--host", u.hostname,
                             "--port", str(u.port)], stdout=log, stderr=log, start_new_session=True)
    deadline = _clock() + 20
    while _clock() < deadline:
        with socket.socket() as s:
            if s.connect_ex((u.hostname, u.port)) == 0:
                return proc
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RunFailed(f"mooncake_http_metadata_server did not come up at {url} (see metadata_server.log)")


def _wait_all(procs, expected: str, timeout_s: float, out: RunResult, signals) -> None:
    deadline = _clock() + timeout_s
    pending = list(procs)
    while pending:
        if signals.caught:
            raise Interrupted
        for p in list(pending):
            if p.conn.poll(0.02):
                try:
                    kind, value = p.conn.recv()
                except (EOFError, OSError):
                    p.proc.join(1.0)
                    raise RunFailed(f"{p.name} exited with code {p.proc.exitcode} while "
                                    "bootstrapping") from None
                if kind == expected:
                    pending.remove(p)
                    p.last_seen = _clock()
                    p.running = expected == "running"
                else:
                    raise RunFailed(f"{p.name} endpoint failed: {value}")
            elif not p.proc.is_alive() and not p.conn.poll(0):
                raise RunFailed(f"{p.name} exited with code {p.proc.exitcode} while bootstrapping")
        if _clock() > deadline:
            raise RunFailed(f"{', '.join(p.name for p in pending)} did not bootstrap in time")


STOP_GRACE_S = 1.0  # after an interrupt, a prefill's own result is awaited this long


def _watch(cfg, prefills, decodes, out: RunResult, log, progress, signals) -> None:
    watchdog = cfg.transport.timeout_s + 5.0  # a prefill reports four times a second
    done: dict[str, int] = Counter()
    stopped_at: Optional[float] = None
    gone: set[int] = set()  # decode instances whose process the runner saw exit
    while not all(p.done for p in prefills):
        if stopped_at is None and not signals.caught:  # (a group signal also ends the decodes)
            _watch_decodes(decodes, prefills, gone, out, log)
        if signals.caught and stopped_at is None:
            stopped_at = out.t_stop = _clock()
            log.warning("interrupted", signal=signals.caught)
            for p in prefills:
                if not p.done:
                    _send(p, "stop")
        for p in prefills:
            if p.done:
                continue
            if p.conn.poll(0.02 / len(prefills)):
                try:
                    kind, value = p.conn.recv()
                except (EOFError, OSError):
                    kind, value = "lost", "its pipe closed"
                p.last_seen = _clock()
                if kind == "progress":
                    done[p.name] = value
                    if progress is not None:
                        progress(sum(done.values()))
                elif kind == "fault":
                    _process_fault(cfg, value, p, decodes, out, log)
                elif kind == "phase":  # a driver with several phases (the bench) began one
                    if progress is not None and hasattr(progress, "phase"):
                        progress.phase(value)
                elif kind == "result":
                    out.add(p.name, value)
                    p.done = True
                else:
                    _lose(p, decodes, out, log, f"endpoint failed: {value}")
            elif not p.proc.is_alive() and not p.conn.poll(0):
                if stopped_at is not None:  # it ended after the interrupt: its records count
                    p.done = True
                    out.slow_to_stop.append(p.name)
                else:
                    _lose(p, decodes, out, log, f"exited with code {p.proc.exitcode}")
            elif stopped_at is None and _clock() - p.last_seen > watchdog:
                _lose(p, decodes, out, log, f"sent nothing for {watchdog:g} s")
        if stopped_at is not None and _clock() - stopped_at > STOP_GRACE_S:
            for p in prefills:  # slow to stop is not lost: its records and the decodes' count
                if not p.done:
                    p.done = True
                    out.slow_to_stop.append(p.name)
                    log.warning("slow_to_stop", process=p.name, grace_s=STOP_GRACE_S)
                    _kill(p)


def _watch_decodes(decodes, prefills, gone: set[int], out: RunResult, log) -> None:
    """A decode process that exited is gone now, not after transport.timeout_s of silence:
    every prefill fails what it owes that instance at once (decode_lost) and goes on."""
    for d in decodes:
        if d.index in gone or d.proc.is_alive() or d.proc.exitcode == 0:
            continue  # (exit 0: it was told to stop, by a signal the runner sees too)
        gone.add(d.index)
        why = f"exited with code {d.proc.exitcode}"
        out.lost.setdefault(d.name, why)
        out.t_stop = out.t_stop or _clock()
        log.error("process_lost", process=d.name, why=why)
        for p in prefills:
            if not p.done:
                _send(p, ("decode_gone", d.index, f"{d.name} {why}"))


def _send(p: _Proc, msg) -> None:
    try:
        p.conn.send(msg)
    except (BrokenPipeError, OSError):
        pass


def _lose(p: _Proc, decodes, out: RunResult, log, why: str) -> None:
    p.done = True
    out.lost[p.name] = why
    out.t_stop = out.t_stop or _clock()
    log.error("process_lost", process=p.name, why=why)
    _kill(p)
    for d in decodes:  # it writes nothing more: its slots can go back
        _send(d, ("prefill_gone", p.index))


def _process_fault(cfg, kind: str, p: _Proc, decodes, out: RunResult, log) -> None:
    """A prefill reached the fault's checkpoint: act, then let it go on."""
    f = cfg.faults
    victim = decodes[0]
    fault = {"fault": kind, "after_handoffs": f.at_request, "at": round(time.time(), 3)}
    out.faults_applied.append(fault)
    log.warning("fault_injected", **fault)
    if kind == FaultKind.prefill_killed.value:
        os.kill(p.proc.pid, signal.SIGKILL)
        return
    if kind == FaultKind.prefill_stopped.value:  # it reads the answer once it runs again
        victim = p
    if kind == FaultKind.decode_killed.value:
        os.kill(victim.proc.pid, signal.SIGKILL)
    else:
        os.kill(victim.proc.pid, signal.SIGSTOP)
        pid = victim.proc.pid

        def resume():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

        threading.Timer(f.duration_s, resume).start()
    _send(p, "fault_done")


def _finish(cfg, run_dir: Path, prefills, decodes, out: RunResult, log, plan_route: str = "") -> None:
    """Stop the decodes, collect their results, account for every lost prefill's requests
    from what is on disk, and end every process."""
    for p in prefills:
        if not p.done and p.proc.is_alive():
            _send(p, "stop")
    if out.interrupted and out.t_stop is None:
        out.t_stop = _clock()
    deadline = _clock() + 1.0
    for p in prefills:  # one that never reached its handoff phase has no result to wait for
        while not p.done and (p.running or not out.interrupted) and _clock() < deadline and p.proc.is_alive():
            if p.conn.poll(0.05):
                try:
                    kind, value = p.conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "result":
                    out.add(p.name, value)
                    p.done = True
    for d in decodes:
        if d.proc.is_alive():
            try:
                os.kill(d.proc.pid, signal.SIGCONT)  # in case a stop fault is still in force
            except ProcessLookupError:
                pass
            _send(d, "stop")
    ran = any(p.running for p in prefills) or not prefills
    deadline = _clock() + ((1.0 if ran else 0.3) if out.interrupted else 10.0)
    own: dict[str, str] = {}  # a decode's own last word: its error
    for d in decodes:
        # a decode that already died may have said why before it did: read its pipe too
        while (d.proc.is_alive() or _readable(d.conn)) and _clock() < deadline:
            if d.conn.poll(0.05):
                try:
                    kind, value = d.conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "stats":
                    out.decodes[d.name] = value
                    break
                if kind == "error":
                    own[d.name] = value
                    if out.error is None:
                        out.error = f"{d.name} endpoint failed: {value}"
                        out.engine_log = _engine_log_tail(run_dir, d.name)
                    break
    deadline = _clock() + (0.5 if not out.interrupted else 0.2)
    for p in prefills + decodes:
        p.proc.join(max(0.0, deadline - _clock()))
        _kill(p)
    for d in decodes:
        if d.name not in out.decodes:
            out.decodes[d.name] = _decode_from_disk(run_dir, d.name)
            if d.name in own:
                out.decodes[d.name].error = f"{own[d.name]} (counts from its verdicts file)"
            if not out.interrupted and out.error is None and d.proc.exitcode not in (0, None):
                out.lost.setdefault(d.name, f"exited with code {d.proc.exitcode}")
    for p in prefills:
        if not out.reported(p.name):
            reason = out.lost.get(p.name)
            out.ranks[p.name] = reconstruct(cfg, run_dir, p.index, p.name,
                                            Detail.interrupted if out.interrupted and not reason else
                                            Detail.prefill_lost if reason else Detail.run_error,
                                            route=plan_route, ran=p.running,
                                            phase=(out.t_phase, out.t_stop))
    ep = cfg.endpoints
    for p in prefills:  # a decode a prefill declared lost (silent past transport.timeout_s)
        rank = out.ranks.get(p.name)  # none where a driver ran
        for inst, why in (rank.lost.items() if rank else ()):
            out.lost.setdefault(proc_name("decode", inst, ep.decode_ranks, 0, ep.decode_tp),
                                f"declared lost by {p.name}: {why}")


def _readable(conn) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return False


def _decode_from_disk(run_dir: Path, name: str) -> DecodeResult:
    res = DecodeResult(name, error="no stats: the process ended early; counts from its verdicts file")
    for v in _verdict_lines(run_dir / f"verdicts-{name}.jsonl"):
        res.outcomes[Outcome(v["outcome"])] += 1
        if v["outcome"] != Outcome.verified.value:
            res.details[Detail(v["detail"])] += 1
    return res


def _verdict_lines(path: Path):
    if not path.exists():
        return
    with open(path) as fh:
        for line in fh:
            if line.endswith("\n"):
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


def reconstruct(cfg: OrchestratorConfig, run_dir: Path, rank: int, name: str, missing: Detail,
                route: str = "", ran: bool = True, phase: tuple = (None, None)) -> RankResult:
    """A prefill rank that could not report: its requests file holds what it recorded;
    a request it did not record keeps the verdict its decode gave it (every decode's
    verdicts file), and is otherwise failed with `missing` as the reason. The records
    added are appended to the requests file, so the file and the report agree.

    After an interrupt (`missing` is interrupted), a request past the last one with any
    trace never arrived (requests arrive in id order): not_started, with no line; a rank
    that never reached its handoff phase (`ran` false) started none. `phase` (the runner's
    clock: the handoff phase began, the run stopped) times a rate over the phase that ran."""
    n = cfg.workload.requests
    base = rank * n
    suffix = "" if cfg.endpoints.prefill_ranks == 1 else f"-{name}"
    path = run_dir / f"requests{suffix}.jsonl"
    from .layout import profile_layout

    res = RankResult(rank, n, row_bytes=sum(f[2] for f in profile_layout(cfg)))
    seen: set[int] = set()
    for rec in read_records(path):
        if base <= rec.rid < base + n and rec.rid not in seen:
            seen.add(rec.rid)
            res.add(rec)
    judged: dict[int, tuple[Outcome, Detail]] = {}
    for f in sorted(run_dir.glob("verdicts-decode*.jsonl")):
        tp_follower = "." in f.stem and not f.stem.endswith(".0")
        if tp_follower:
            continue  # a TP instance's verdict is its leader's
        for v in _verdict_lines(f):
            if v.get("prefill") == rank:
                judged[v["rid"]] = (Outcome(v["outcome"]), Detail(v["detail"]))
    from .workload import room_of

    end = base + n
    if missing is Detail.interrupted:
        traced = [r for r in (*seen, *judged) if base <= r < base + n]
        end = (max(traced) + 1) if traced and ran else base
        res.not_started = base + n - end
        res.interrupted = True
    added = []
    for rid in range(base, end):
        if rid in seen:
            continue
        outcome, detail = judged.get(rid, (Outcome.failed, missing))
        rec = Record(rid, room_of(cfg.workload, rid), rid % cfg.endpoints.decode_ranks, -1,
                     route if rid in judged else "", None, None, None, None, outcome, detail, "", None)
        res.add(rec)
        added.append(rec)
    t_phase, t_stop = phase
    if res.verified and t_phase is not None and t_stop is not None and res.t_start is None:
        res.t_start, res.t_last = t_phase, t_stop  # no verdict times: the phase as the runner saw it
    if added:
        # complete lines only: a torn last line is cut off before appending
        if path.exists():
            data = path.read_bytes()
            cut = data.rfind(b"\n") + 1
            if cut != len(data):
                with open(path, "r+b") as fh:
                    fh.truncate(cut)
        with open(path, "a") as fh:
            for rec in added:
                fh.write(rec.line() + "\n")
    res.error = f"{name} did not report; {len(added)} requests accounted for from the decode's verdicts"
    return res
