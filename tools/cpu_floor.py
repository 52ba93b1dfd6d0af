"""CPU accounting under the 2-core box's inline goal (issue 39: the default run >= 0.8x raw
back-to-back writes): what Mooncake's TCP transport itself burns per write, on both sides,
against what the box has at 0.8x the raw rate, and where a default run's CPU goes.

    python tools/cpu_floor.py floor [SECONDS [ROUNDS]]  # the floor: 3 s a mode, 3 rounds
    python tools/cpu_floor.py run [OVERRIDES..]         # `python -m orchestrator OVERRIDES`
                                                        # (default workload.requests=20000),
                                                        # its processes' CPU from /proc

`floor` measures, in two processes (prefill: this one; decode: a forked child), each with
its own Mooncake engine (MC_FORCE_TCP=1, P2PHANDSHAKE on 127.0.0.1, as the CPU box's runs:
orchestrator.profile.plan.engine_env) and the default profile's buffers (conf/buffers/
default.yaml: 64 slots, 1,600 B a row in 10 fields, registered whole, as the run does):

  sync          Mooncake's raw batch_transfer_sync_write of one request's 10 blocks, back to
                back, slot i % 64 (the bench's "raw back-to-back writes of one request")
  sync@0.8x     the same, paced at 0.8x this round's `sync` rate (no sleep: the caller spins
                until the next slot's time; that spin is counted apart, as "pacing")
  nap           the run's completion on this box (transport.mooncake.completion=auto -> nap
                below 8 cores): batch_transfer_async_write, sleep nap_us (50 us), then
                get_batch_transfer_status, back to back
  nap@0.8x      nap paced at 0.8x this round's `sync` rate
  async@0.8x    at 0.8x the `sync` rate, spin-paced: submit write i (batch_transfer_async_write),
                then get_batch_transfer_status of write i-1 (one period old: landed, so the
                call returns without polling): the least the caller can spend on a write
  set_buf       SGLang 0.5.23's own set_buf (compiled from the installed wheel, as
                tools/setbuf_floor.py) on the default workload's requests: thread CPU a call
  zmq status    a 60-byte status PUSH -> PULL and a verdict of the sealed UpdateMsg's length
                back ROUTER -> DEALER (the run's sockets; bytes prepared ahead: ZMQ alone),
                blocking receives (endpoints.poll=auto -> block below 8 cores); one in flight
                and 8 in flight (the default workload.concurrency)

For each mode: the wall rate and the CPU each process spent in the timed window, every thread
included (per thread: /proc/<pid>/task/<tid>/schedstat, ns; user/sys from .../stat, 10 ms
ticks), as CPU us per write (or per call, per message) and cores busy (CPU s / wall s).
Threads are labelled main (the caller: "in calls" is its CPU inside Mooncake's calls, by
thread_time; "outside" the pacing spin and the loop), mooncake (the threads the engine's
initialize started; one of them works: TcpTransport::worker), zmq (ZMQbg/*: libzmq's I/O
threads) or other. "Mooncake" = every thread of both processes but the caller's "outside".

The box is shared: each window starts once the box's other work is under 0.1 cores (waits up
to 300 s), and each says what /proc/stat counted busy over it and how much of that was not our
threads ("others"; NOT QUIET at 0.1 cores and over). /proc/stat counts by ticks and misses
bursts, so "box" can read below our threads' schedstat sum: "others" is a lower bound. The
budget takes the medians of the rounds whose every window was quiet (all rounds if none was).

Then the budget: at 0.8x the raw rate R (median `sync` rate), the box has 2 cores / (0.8 R)
of CPU per request; minus Mooncake's CPU per write at that rate, minus SGLang's set_buf, minus
the status's round trip: what is left per request for everything else (digest, status and
verdict framing, the decode's check, records). If it is negative, Mooncake's transport plus
set_buf alone cannot reach 0.8x raw on this box, whatever the project's code does.

`run` starts `python -m orchestrator` (the default profile: inline fill, per-request writes,
concurrency 8) into a fresh run dir, finds its prefill and decode processes (children of its
forkserver; named by the run dir's log files they hold open: prefill.log, decode.log), samples
every thread's CPU every 20 ms, names the Python threads from a `py-spy dump` mid-run (the
others: zmq by name; "Mooncake TcpTransport worker" for a native thread seen in epoll_wait;
else native), and prints CPU us per handoff per process and per thread over the run's own
window (prefill_loop logged -> + results.json's wall_s), with handoffs/s from results.json,
the box's busy CPU and the busiest other processes (NOT QUIET: others at 0.1 cores or over).

Read `run` against `floor`: per handoff, Mooncake's worker threads, its calls on the sender
thread (nap's "in calls"), set_buf and the status's sockets are outside this project's code;
the rest of MainThread, sender and the decode's MainThread is ours. A process's Python threads
share one GIL: their cores summed near 1.0 mean that process is bound by its Python, not by
the box.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Optional

CORES = os.cpu_count() or 1
TICK = os.sysconf("SC_CLK_TCK")
SLOTS = 64
WARM = 500
NAP_S = 50e-6  # transport.mooncake.nap_us's default
PACE = 0.8  # the goal's fraction of the raw rate
PY = sys.executable


# ---- /proc accounting ----------------------------------------------------------------------
@dataclass
class Thread:
    """One thread's CPU at a moment: run_ns from schedstat, user/sys from stat (clock ticks)."""

    comm: str
    run_ns: int
    utime: int
    stime: int


_COMM: dict[str, str] = {}


def threads(pid: int, split: bool = True) -> dict[int, Thread]:
    """Every live thread of `pid` (a thread gone between listing and reading is skipped);
    `split`: user and sys too (one more file a thread; else 0)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        path = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{path}/schedstat") as fh:
                run_ns = int(fh.read().split()[0])
            ut = st = 0
            if split:
                with open(f"{path}/stat") as fh:
                    rest = fh.read().rsplit(")", 1)[1].split()
                ut, st = int(rest[11]), int(rest[12])
            if path not in _COMM:
                with open(f"{path}/comm") as fh:
                    _COMM[path] = fh.read().strip()
        except (OSError, IndexError, ValueError):
            continue
        out[int(tid)] = Thread(_COMM[path], run_ns, ut, st)
    return out


def proc_ticks(pid: int) -> tuple[int, int]:
    """The process's utime, stime (clock ticks; exited threads included)."""
    with open(f"/proc/{pid}/stat") as fh:
        rest = fh.read().rsplit(")", 1)[1].split()
    return int(rest[11]), int(rest[12])


def box() -> tuple[float, float]:
    """The box's busy and steal CPU seconds so far, all CPUs (/proc/stat: everything but idle
    and iowait is busy; softirq work the kernel does not charge to a thread is in it)."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK, v[7] / TICK


def wait_quiet(limit_s: float = 300.0, cores: float = 0.1) -> float:
    """Until the box's other work uses under `cores` over half a second (at most `limit_s`);
    returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        a = box()[0]
        time.sleep(0.5)
        if (box()[0] - a) / 0.5 < cores or time.monotonic() - t0 > limit_s:
            return time.monotonic() - t0


@dataclass
class Used:
    """CPU one thread used over a window."""

    label: str
    s: float  # CPU seconds (schedstat)
    user_s: float
    sys_s: float


def used(before: dict[int, Thread], after: dict[int, Thread], label: Callable[[int, str], str]) -> list[Used]:
    out = []
    for tid, b in after.items():
        a = before.get(tid, Thread(b.comm, 0, 0, 0))
        out.append(Used(label(tid, b.comm), (b.run_ns - a.run_ns) / 1e9, (b.utime - a.utime) / TICK,
                        (b.stime - a.stime) / TICK))
    return out


# ---- floor: two processes, one Mooncake engine each -----------------------------------------
def _buffers() -> Any:
    import torch

    from orchestrator import MetadataBuffers

    # conf/buffers/default.yaml: size 64, hidden 16 float32, 256 sampling-mask tokens (off),
    # 128 top logprobs, no DSA indices, kv_checksum off -> 1,600 B a row in 10 fields
    return MetadataBuffers(SLOTS, 16, torch.float32, 256, 128, None, 0, kv_checksum_enabled=False,
                           enable_sampling_mask=False)


def _engine() -> tuple[Any, set[int]]:
    """A Mooncake engine as the CPU box's runs start it, and the threads its start created."""
    from orchestrator.handoff.backends.mooncake.engine import MooncakeEngine
    from orchestrator.profile.plan import EngineTransport, engine_env

    before = set(threads(os.getpid()))
    eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp", "", env=engine_env(EngineTransport.tcp, 5))
    assert eng.effective_transport is EngineTransport.tcp, eng.init_log
    return eng, set(threads(os.getpid())) - before


def _decode(conn: Any) -> None:
    bufs = _buffers()
    eng, mc = _engine()
    eng.register(bufs.arena_ptr, bufs.arena_bytes)
    conn.send((eng.session_id, [t.data_ptr() for t in bufs.fields], sorted(mc)))
    conn.recv()  # blocks (no CPU) until the prefill is done


def _labeller(pid: int, mooncake: set[int]) -> Callable[[int, str], str]:
    def label(tid: int, comm: str) -> str:
        if tid == pid:
            return "main"
        if tid in mooncake:
            return "mooncake"
        return "zmq" if comm.startswith("ZMQ") else "other"

    return label


@dataclass
class Mode:
    """One timed window of writes: its count, wall time and every thread's CPU (both sides)."""

    name: str
    n: int
    wall_s: float
    in_call_s: float  # the caller's own CPU inside Mooncake's calls (thread_time)
    rows: list[tuple[str, Used]] = field(default_factory=list)  # (process, thread)
    box_s: float = 0.0  # the box's busy CPU seconds over the window (/proc/stat)
    steal_s: float = 0.0

    @property
    def others_s(self) -> float:
        """The box's busy CPU not in our threads: other processes, uncharged kernel work."""
        return max(0.0, self.box_s - self.cpu_s())

    def quiet(self) -> str:
        o = self.others_s / self.wall_s
        return (f"box {self.box_s / self.wall_s:4.2f} cores busy, others {o:4.2f}"
                + (f", steal {self.steal_s / self.wall_s:4.2f}" if self.steal_s > 0.01 * self.wall_s else "")
                + ("" if o < 0.1 else " NOT QUIET"))

    @property
    def rate(self) -> float:
        return self.n / self.wall_s

    def cpu_s(self, proc: Optional[str] = None, label: Optional[str] = None) -> float:
        return sum(u.s for p, u in self.rows if (proc is None or p == proc) and (label is None or u.label == label))

    @property
    def pacing_s(self) -> float:
        """The caller's CPU outside Mooncake's calls: the pacing spin and the loop."""
        return max(0.0, self.cpu_s("prefill", "main") - self.in_call_s)

    @property
    def mooncake_s(self) -> float:
        return self.cpu_s() - self.pacing_s

    def us(self, s: float) -> float:
        return s / self.n * 1e6

    def report(self) -> str:
        lines = [f"  {self.name:10s} {self.n:7d} writes in {self.wall_s:5.2f} s = {self.rate:8.1f}/s; CPU us a "
                 f"write: Mooncake (both sides, pacing excluded) {self.us(self.mooncake_s):6.1f} = "
                 f"{self.mooncake_s / self.wall_s:4.2f} cores; all threads: {self.us(self.cpu_s()):6.1f}, "
                 f"{self.cpu_s() / self.wall_s:4.2f} of {CORES} cores busy ({self.quiet()})"]
        by: dict[tuple[str, str], list[float]] = {}
        for proc, u in self.rows:
            acc = by.setdefault((proc, u.label), [0.0, 0.0, 0.0, 0.0])
            acc[0] += u.s
            acc[1] += u.user_s
            acc[2] += u.sys_s
            acc[3] += u.s > 0.005 * self.wall_s  # threads that did something (> 0.5% of a core)
        for (proc, lab), (s, us_, ss, k) in sorted(by.items()):
            if s < 0.002 * self.wall_s:
                continue
            if proc == "prefill" and lab == "main":
                lines.append(f"      prefill  main in calls   {self.us(self.in_call_s):6.1f} us/write")
                if self.pacing_s > 0.002 * self.wall_s:
                    lines.append(f"      prefill  main outside    {self.us(self.pacing_s):6.1f} us/write")
                continue
            lines.append(f"      {proc:8s} {lab:9s} x{int(k):<3d} {self.us(s):6.1f} us/write "
                         f"(user {self.us(us_):5.1f}, sys {self.us(ss):5.1f}; {s / self.wall_s:4.2f} cores)")
        return "\n".join(lines)


class Pair:
    """This process as the prefill, a forked child as the decode, one engine each."""

    def __init__(self) -> None:
        self.conn, child = mp.Pipe()
        self.child = mp.get_context("fork").Process(target=_decode, args=(child,), daemon=True)
        self.child.start()
        self.bufs = _buffers()
        self.eng, mc = _engine()
        self.eng.register(self.bufs.arena_ptr, self.bufs.arena_bytes)
        self.session, dst_ptrs, dec_mc = self.conn.recv()
        lens = self.bufs.item_lens
        src_ptrs = [t.data_ptr() for t in self.bufs.fields]
        self.blocks = [([p + k * s for p, k in zip(src_ptrs, lens)], [p + k * s for p, k in zip(dst_ptrs, lens)],
                        list(lens)) for s in range(SLOTS)]
        self.engine_threads = (len(mc), len(dec_mc))
        self.label = {"prefill": _labeller(os.getpid(), mc), "decode": _labeller(self.child.pid or 0, set(dec_mc))}
        self.pids = {"prefill": os.getpid(), "decode": self.child.pid or 0}
        self._prev = 0  # async: the write submitted last, not yet reaped
        te = self.eng.raw
        for i in range(WARM):  # the connection and the engine's first-use work
            self._sync(te, i)

    def _sync(self, te: Any, i: int) -> None:
        srcs, dsts, lens = self.blocks[i % SLOTS]
        rc = te.batch_transfer_sync_write(self.session, srcs, dsts, lens)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

    def _nap(self, te: Any, i: int) -> None:
        srcs, dsts, lens = self.blocks[i % SLOTS]
        batch = te.batch_transfer_async_write(self.session, srcs, dsts, lens)
        if batch == 0:
            raise RuntimeError("batch_transfer_async_write returned 0")
        time.sleep(NAP_S)
        rc = te.get_batch_transfer_status([batch])
        if rc != 0:
            raise RuntimeError(f"get_batch_transfer_status returned {rc}")

    def _piped(self, te: Any, i: int) -> None:
        srcs, dsts, lens = self.blocks[i % SLOTS]
        batch = te.batch_transfer_async_write(self.session, srcs, dsts, lens)
        if batch == 0:
            raise RuntimeError("batch_transfer_async_write returned 0")
        self._reap()
        self._prev = batch

    def _reap(self) -> None:
        if self._prev:
            rc = self.eng.raw.get_batch_transfer_status([self._prev])
            if rc != 0:
                raise RuntimeError(f"get_batch_transfer_status returned {rc}")
        self._prev = 0

    def window(self, name: str, seconds: float, rate: Optional[float] = None) -> Mode:
        """Writes for `seconds`, back to back or paced at `rate` a second (spinning)."""
        te, pc, tt = self.eng.raw, time.perf_counter, time.thread_time_ns
        call = {"nap": self._nap, "async": self._piped}.get(name.split("@")[0], self._sync)
        self._prev = 0
        wait_quiet()
        before = {p: threads(pid) for p, pid in self.pids.items()}
        b0 = box()
        in_call = n = 0
        t0 = pc()
        end = t0 + seconds
        period = 1.0 / rate if rate else 0.0
        while True:
            if period:
                slot = t0 + n * period
                while pc() < slot:
                    pass
            c = tt()
            call(te, n)
            in_call += tt() - c
            n += 1
            if pc() >= end:
                break
        c = tt()
        self._reap()
        in_call += tt() - c
        wall = pc() - t0
        b1 = box()
        after = {p: threads(pid) for p, pid in self.pids.items()}
        m = Mode(name, n, wall, in_call / 1e9, box_s=b1[0] - b0[0], steal_s=b1[1] - b0[1])
        for p in self.pids:
            m.rows += [(p, u) for u in used(before[p], after[p], self.label[p])]
        return m

    def close(self) -> None:
        self.conn.send("done")
        self.child.join(10)


def setbuf_cpu(n: int) -> tuple[float, float]:
    """SGLang 0.5.23's own set_buf on the default workload's requests: thread CPU us a call,
    and wall us a call, over `n` calls (one process, nothing else running)."""
    import torch

    from orchestrator.handoff.specs import WorkloadSpec
    from orchestrator.handoff.workload import RequestPool, Shapes
    from orchestrator.profile.kinds import FillMode
    from tests.helpers.sglang_oracle import load

    theirs = load().MetadataBuffers(SLOTS, 16, torch.float32, 256, 128, None, 0, kv_checksum_enabled=False)
    w = WorkloadSpec(n, 8, None, 1, FillMode.inline, 1, True, 5, True, False, False, True, 7, None, 1.0)
    pool = RequestPool(w, Shapes(16, torch.float32, 0, 256, "cpu"))
    reqs = [pool.get(i + 1, i % SLOTS) for i in range(n)]
    for r in reqs[:200]:
        theirs.set_buf(r)
    c, t = time.thread_time_ns(), time.perf_counter()
    for r in reqs:
        theirs.set_buf(r)
    return (time.thread_time_ns() - c) / n / 1e3, (time.perf_counter() - t) / n * 1e6


# ---- the status: ZMQ alone -------------------------------------------------------------------
def _verdict_len() -> int:
    from orchestrator.handoff.transport import wire
    from orchestrator.handoff.transport.auth import Session
    from orchestrator.results.outcomes import Detail, Outcome

    s = Session(os.urandom(32), os.urandom(32))
    t = time.monotonic_ns()
    return len(s.seal(wire.encode(wire.UpdateMsg(grants=[], v=[[1, Outcome.verified.code, Detail.none.code,
                                                                 t, t, t]]))))


def _zmq_decode(n: int, verdict: int, conn: Any) -> None:
    import zmq

    ctx = zmq.Context()
    pull, router = ctx.socket(zmq.PULL), ctx.socket(zmq.ROUTER)
    at = (pull.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1"))
    conn.send(at)
    ident = router.recv_multipart()[0]  # the prefill's hello
    body = b"v" * verdict
    for _ in range(n):
        pull.recv()
        router.send_multipart([ident, body])
    conn.recv()


def zmq_status(n: int, inflight: int) -> Mode:
    """`n` 60-byte statuses, each answered by a verdict, `inflight` at a time, blocking."""
    import zmq

    conn, child = mp.Pipe()
    p = mp.get_context("fork").Process(target=_zmq_decode, args=(n + WARM, _verdict_len(), child), daemon=True)
    p.start()
    pull_at, ctl_at = conn.recv()
    ctx = zmq.Context()
    push, dealer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    push.connect(f"tcp://127.0.0.1:{pull_at}")
    dealer.connect(f"tcp://127.0.0.1:{ctl_at}")
    dealer.send(b"hello")
    status = b"s" * 60
    for _ in range(WARM):
        push.send(status)
        dealer.recv()
    pids = {"prefill": os.getpid(), "decode": p.pid or 0}
    label = {k: _labeller(pid, set()) for k, pid in pids.items()}
    wait_quiet()
    before = {k: threads(pid) for k, pid in pids.items()}
    b0 = box()
    t0 = time.perf_counter()
    sent = got = 0
    while got < n:
        while sent < n and sent - got < inflight:
            push.send(status)
            sent += 1
        dealer.recv()
        got += 1
    wall = time.perf_counter() - t0
    b1 = box()
    after = {k: threads(pid) for k, pid in pids.items()}
    m = Mode(f"zmq {inflight} in flight", n, wall, 0.0, box_s=b1[0] - b0[0], steal_s=b1[1] - b0[1])
    for k in pids:
        m.rows += [(k, u) for u in used(before[k], after[k], label[k])]
    conn.send("done")
    p.join(10)
    ctx.destroy(linger=0)
    return m


def floor(seconds: float, rounds: int = 3) -> None:
    print(f"load before: {open('/proc/loadavg').read().strip()}; {CORES} cores; {seconds:g} s a mode, "
          f"{rounds} interleaved rounds")
    pair = Pair()
    print(f"rows: {pair.bufs.row_bytes} B in {len(pair.bufs.item_lens)} blocks {pair.bufs.item_lens}; "
          f"Mooncake tcp; threads its initialize started: prefill {pair.engine_threads[0]}, "
          f"decode {pair.engine_threads[1]}")
    done: list[dict[str, Any]] = []  # per round: mode name -> Mode, "set_buf" -> (CPU us, wall us)
    try:
        for r in range(rounds):
            print(f"round {r + 1}:")
            raw = pair.window("sync", seconds)
            got: dict[str, Any] = {"sync": raw}
            for name in ("sync@0.8x", "nap", "nap@0.8x", "async@0.8x"):
                got[name] = pair.window(name, seconds, PACE * raw.rate if "@" in name else None)
            for m in got.values():
                print(m.report())
            wait_quiet()
            cpu, wall = got["set_buf"] = setbuf_cpu(4000)
            quiet = wall < 1.05 * cpu  # (a 0.2 s window: /proc/stat's ticks are too coarse for it)
            print(f"  set_buf    SGLang 0.5.23's own: {cpu:6.1f} CPU us a call ({wall:6.1f} us wall"
                  f"{'' if quiet else ': preempted, NOT QUIET'})")
            for k in (1, 8):
                z = got[f"zmq{k}"] = zmq_status(5000, k)
                print(f"  {z.name:18s} {z.rate:8.1f}/s; CPU us a status + verdict: prefill "
                      f"{z.us(z.cpu_s('prefill')):5.1f}, decode {z.us(z.cpu_s('decode')):5.1f}, "
                      f"both {z.us(z.cpu_s()):5.1f} ({z.cpu_s() / z.wall_s:4.2f} cores; {z.quiet()})")
            got["quiet"] = quiet and all(m.others_s < 0.1 * m.wall_s for m in got.values() if isinstance(m, Mode))
            done.append(got)
    finally:
        pair.close()
    use = [d for d in done if d["quiet"]] or done
    med = statistics.median
    rate = med(d["sync"].rate for d in use)
    goal = PACE * rate
    have = CORES / goal * 1e6
    print(f"\nbudget at {PACE}x raw: medians of {len(use)} rounds ("
          + (f"the quiet ones: {[i + 1 for i, d in enumerate(done) if d['quiet']]}" if use is not done else
             "none was quiet: all of them") + f"); load after: {open('/proc/loadavg').read().strip()}")
    print(f"  raw back-to-back sync writes {rate:8.1f}/s -> goal {goal:8.1f} handoffs/s")
    print(f"  the box: {CORES} cores / {goal:.1f}/s = {have:7.1f} CPU us a request")
    set_buf = med(d["set_buf"][0] for d in use)
    z1, z8 = (med(d[f"zmq{k}"].us(d[f"zmq{k}"].cpu_s()) for d in use) for k in (1, 8))
    for paced in ("sync@0.8x", "nap@0.8x", "async@0.8x"):
        ms = [d[paced] for d in use]
        mc = med(m.us(m.mooncake_s) for m in ms)
        reached = med(m.rate for m in ms)
        side = {p: med(m.us(m.cpu_s(p) - (m.pacing_s if p == "prefill" else 0.0)) for m in ms)
                for p in ("prefill", "decode")}
        left = have - mc - set_buf - z8
        print(f"  with {paced} ({reached:8.1f}/s reached): Mooncake {mc:6.1f} (prefill {side['prefill']:6.1f}, "
              f"decode {side['decode']:6.1f}), set_buf {set_buf:5.1f}, status+verdict {z8:5.1f} (8 in flight; "
              f"{z1:5.1f} one in flight) -> left {left:7.1f} CPU us a request ({left / have:5.1%} of the box)")
    back = {name: med(d[name].us(d[name].mooncake_s) for d in use)
            for name in ("sync", "sync@0.8x", "nap", "nap@0.8x", "async@0.8x")}
    print("  Mooncake CPU us a write, medians: " + ", ".join(f"{k} {v:.1f}" for k, v in back.items()))


# ---- run: the default run's processes, sampled ------------------------------------------------
_ROLE = re.compile(r"/(prefill\d*|decode[\d.]*)(?:\.stderr)?\.log$")
_PYSPY_THREAD = re.compile(r'^Thread (\d+) \(([^)]*)\): "(.*)"$', re.M)


def _children(pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as fh:
                rest = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[1]) == pid:
            out.append(int(stat.split("/")[2]))
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _all_procs() -> dict[int, tuple[str, float]]:
    """Every process's command line (60 chars) and CPU seconds so far."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            u, s = proc_ticks(int(d))
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                cmd = fh.read(200).replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[int(d)] = (cmd, (u + s) / TICK)
    return out


def _role(pid: int, run_dir: str) -> Optional[str]:
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        m = _ROLE.search(target)
        if target.startswith(run_dir) and m:
            return m[1]
    return None


EPOLL_WAIT = {"232", "281"}  # x86_64 epoll_wait, epoll_pwait


def _epoll_threads(pid: int, named: dict[int, str]) -> dict[int, str]:
    """The native threads (no Python name, not libzmq's) seen blocked in epoll_wait in 10
    looks 20 ms apart: in an endpoint on this box that is Mooncake's TcpTransport::worker
    (asio's io_context; `gdb -p PID -batch -ex "thread apply all bt"` showed it, the
    others being Go runtime threads in futex and the handshake daemon in accept)."""
    seen = {}
    for _ in range(10):
        for tid in os.listdir(f"/proc/{pid}/task"):
            if int(tid) in named or int(tid) in seen:
                continue
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                    if fh.read().startswith("ZMQ"):
                        continue
                with open(f"/proc/{pid}/task/{tid}/syscall") as fh:
                    if fh.read().split()[0] in EPOLL_WAIT:
                        seen[int(tid)] = "Mooncake TcpTransport worker"
            except (OSError, IndexError):
                continue
        time.sleep(0.02)
    return seen


def _pyspy_names(pid: int) -> dict[int, str]:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(PY), "py-spy")
    try:
        out = subprocess.run([spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(tid): name for tid, _, name in _PYSPY_THREAD.findall(out)}


def _ts(line: str) -> float:
    stamp = json.loads(line)["timestamp"].replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


def _interp(pts: list[tuple[float, float]], t: float) -> float:
    for (ta, va), (tb, vb) in zip(pts, pts[1:]):
        if ta <= t <= tb:
            return va + (vb - va) * (t - ta) / (tb - ta) if tb > ta else vb
    return pts[-1][1] if t > pts[-1][0] else pts[0][1]


def run(overrides: list[str]) -> None:
    print(f"load before: {open('/proc/loadavg').read().strip()}; waited {wait_quiet():.1f} s for a quiet box")
    run_dir = tempfile.mkdtemp(prefix="cpu_floor_run_")
    cmd = [PY, "-m", "orchestrator", *(overrides or ["workload.requests=20000"]), f"hydra.run.dir={run_dir}"]
    print("$ " + " ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    roles: dict[int, str] = {proc.pid: "orchestrator", os.getpid(): "this tool"}
    samples: list[tuple[float, dict[int, dict[int, Thread]], dict[int, tuple[int, int]]]] = []
    boxes: list[tuple[float, float]] = []
    everyone: list[tuple[float, dict[int, tuple[str, float]]]] = []  # every process, each second
    names: dict[int, str] = {}
    stop = threading.Event()

    def sample() -> None:
        k = 0
        spied = None
        while not stop.is_set():
            found = {r[:4] for r in roles.values()}
            if k % 10 == 0 and not {"pref", "deco"} <= found:  # new processes, every 200 ms
                for pid in _descendants(proc.pid):
                    if pid not in roles or roles[pid] == "other":
                        roles[pid] = _role(pid, run_dir) or "other"
            k += 1
            snap, ticks = {}, {}
            for pid in list(roles):
                try:
                    ticks[pid] = proc_ticks(pid)
                    snap[pid] = threads(pid, split=False)
                except OSError:
                    continue
            samples.append((time.time(), snap, ticks))
            boxes.append((time.time(), box()[0]))
            if k % 50 == 1:
                everyone.append((time.time(), _all_procs()))
            if spied is None and os.path.exists(os.path.join(run_dir, "prefill.log")):
                with open(os.path.join(run_dir, "prefill.log")) as fh:
                    if '"prefill_loop"' in fh.read():
                        spied = time.time() + 1.0  # mid-run: every thread started
            if spied is not None and time.time() > spied:
                spied = float("inf")
                for pid, role in list(roles.items()):
                    for _ in range(3):  # a dump that raced the target names nothing: again
                        if role.startswith(("prefill", "decode")) and pid not in names:
                            names.update(_pyspy_names(pid))
                    if role.startswith(("prefill", "decode")):
                        names.update(_epoll_threads(pid, names))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = proc.communicate()
    stop.set()
    t.join()
    print(out.strip())
    print(f"load after: {open('/proc/loadavg').read().strip()}")
    with open(os.path.join(run_dir, "results.json")) as fh:
        res = json.load(fh)
    with open(os.path.join(run_dir, "prefill.log")) as fh:
        t0 = next(_ts(line) for line in fh if '"prefill_loop"' in line)
    wall = res["wall_s"]
    n = res["verified"]
    t1 = t0 + wall

    def at(t: float, pid: int, tid: Optional[int]) -> Optional[float]:
        """CPU seconds of thread `tid` (None: the process's utime+stime) at time t, interpolated."""
        pts = []
        for ts, snap, ticks in samples:
            if tid is None:
                if pid in ticks:
                    pts.append((ts, sum(ticks[pid]) / TICK))
            elif tid in snap.get(pid, {}):
                pts.append((ts, snap[pid][tid].run_ns / 1e9))
        if not pts:
            return None
        return 0.0 if t < pts[0][0] else _interp(pts, t)  # first seen after t: born after it

    print(f"\nwindow: prefill_loop + wall_s {wall} s; {n} verified, {res['handoffs_per_s']} handoffs/s "
          f"(results.json); samples every 20 ms: {len(samples)}")
    print(f"{'process':12s} {'thread':36s} {'CPU us/handoff':>14s} {'cores':>6s}")
    total = mine = 0.0
    for pid, role in sorted(roles.items(), key=lambda kv: kv[1]):
        a, b = at(t0, pid, None), at(t1, pid, None)
        if a is None or b is None:
            continue
        tids = sorted({tid for _, snap, _ in samples for tid in snap.get(pid, {})})
        rows = []
        for tid in tids:
            ta, tb = at(t0, pid, tid), at(t1, pid, tid)
            if ta is None or tb is None or tb - ta < 0.002 * wall:
                continue
            comm = next(snap[pid][tid].comm for _, snap, _ in samples if tid in snap.get(pid, {}))
            lab = names.get(tid) or ("zmq " + comm if comm.startswith("ZMQ") else
                                     "main" if tid == pid else "native (no Python frames)")
            rows.append((tb - ta, f"{tid} {lab}"[:36]))
        proc_s = sum(r[0] for r in rows)
        if role == "this tool":
            mine = proc_s
        else:
            total += proc_s
        if proc_s < 0.002 * wall:
            continue
        print(f"{role:12s} {'all threads (schedstat)':36s} {proc_s / n * 1e6:14.1f} {proc_s / wall:6.2f}"
              f"   (utime+stime ticks: {(b - a) / n * 1e6:.1f})")
        for s, lab in sorted(rows, reverse=True):
            print(f"{'':12s} {lab:36s} {s / n * 1e6:14.1f} {s / wall:6.2f}")
    print(f"{'the run':12s} {'(all but this tool)':36s} {total / n * 1e6:14.1f} {total / wall:6.2f} of {CORES} cores")
    busy = _interp(boxes, t1) - _interp(boxes, t0)
    others = max(0.0, busy - total - mine) / wall
    print(f"{'the box':12s} {'/proc/stat busy':36s} {busy / n * 1e6:14.1f} {busy / wall:6.2f}   (others: "
          f"{others:4.2f} cores{'' if others < 0.1 else ', NOT QUIET'})")
    ea = max((e for e in everyone if e[0] <= t0), default=everyone[0], key=lambda e: e[0])
    eb = min((e for e in everyone if e[0] >= t1), default=everyone[-1], key=lambda e: e[0])
    span = eb[0] - ea[0]
    busiest = sorted(((v[1] - ea[1].get(pid, (v[0], 0.0))[1], pid, v[0]) for pid, v in eb[1].items()
                      if pid not in roles), reverse=True)[:3]
    print(f"busiest other processes over about the window ({span:.1f} s): "
          + "; ".join(f"{pid} {name[:60]} {s / span:.2f} cores" for s, pid, name in busiest if s > 0))
    print(f"run dir: {run_dir}")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "floor"
    if what == "floor":
        floor(float(sys.argv[2]) if len(sys.argv) > 2 else 3.0, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
    elif what == "run":
        run(sys.argv[2:])
    else:
        sys.exit(__doc__.split("\n\n")[1])


if __name__ == "__main__":
    main()
