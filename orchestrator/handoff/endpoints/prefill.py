"""Prefill endpoint (sender), shaped like SGLang's prefill scheduler.

A request is announced to its decode instance when it ARRIVES ("arrive", in bulk); decode
grants it a slot then, as SGLang's decode pre-allocates while the request bootstraps, so a
finished prefill never waits for a grant. Granted requests are taken `workload.batch_size`
at a time by a forward step, which

  1. fills each request's row (inline: SGLang's set_buf, timed per request as set_buf_us;
     ahead: every slot was filled before the timed phase, a request writes its room only),
  2. takes one digest pass over the whole step on the buffers' device (orchestrator.digest)
     and writes each tag into the row's kv_checksum field where the layout has one,
  3. hands the step to the transfer thread and goes on with the next step.

The transfer thread runs the sends (orchestrator.transport.router: one batch write per request, or per
run of consecutive slots) and the status messages, overlapping with the next step's fill as
SGLang's transfer workers overlap its scheduler. Verdicts come back in batches. A decode
instance silent for `transport.timeout_s` while it owes us something is declared lost; its
requests fail with a reason, and the run goes on with the others. The other way round, the
loop tells every live instance something (an empty arrive when nothing else is due) at least
every min(1 s, timeout_s/4): a role=decode side, which cannot see this process, declares a
prefill rank silent for timeout_s lost even when it holds nothing of it.

Requests are identified by (prefill rank, request id) everywhere, never by room: duplicate
rooms (retries, n>1 sampling) each get their own slot and verdict.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import zmq

from orchestrator.handoff import protocol
from orchestrator.handoff.buffers import SlotAllocator, StagedRows
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.endpoints.common import (
    Stop,
    build_side,
    heartbeat_s,
    new_socket,
    process_gpu,
    report_failure,
    rss_kb,
    shapes,
    start_process,
)
from orchestrator.handoff.faults import LoopFaults, wrap
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, Replayed, new_nonce
from orchestrator.handoff.transport.engine import EngineError, MooncakeEngine
from orchestrator.handoff.transport.router import AuxRouter, LayoutMismatch, Peer, Send, Transfer
from orchestrator.handoff.workload import RequestPool, arrival_offsets, decode_of, room_of
from orchestrator.profile.config import CompletionSetting, FillMode, OrchestratorConfig, SetBufMode, StatusMode
from orchestrator.profile.layout import describe, fingerprint, first_difference
from orchestrator.profile.plan import Plan, same_process_space_rule
from orchestrator.profile.platform import boot_id, pid_namespace
from orchestrator.results.logs import DecisionLog
from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import RankResult, Record
from orchestrator.results.rundir import RunFiles, proc_name

_clock = time.monotonic
ISSUE_BUDGET = 4096  # arrivals per pass of the loop (see _Loop.issue)


@dataclass
class Phase:
    """One timed run of the workload (a plain run has one; the benchmark several)."""

    requests: int
    concurrency: int
    rate: Optional[float] = None
    batch_size: int = 1
    fill: FillMode = FillMode.inline
    coalesce: bool = False
    status: StatusMode = StatusMode.per_request
    rid_base: int = 0  # request ids of this phase start here (unique per prefill rank)
    set_buf: SetBufMode = SetBufMode.sglang
    duration_s: Optional[float] = None  # arrivals stop this long after the phase began
    burstiness: float = 1.0  # open loop: the gamma shape of the gaps (1: Poisson)

    @classmethod
    def of(cls, cfg: OrchestratorConfig, rank: int) -> "Phase":
        w, t = cfg.workload, cfg.transport
        return cls(w.requests, w.concurrency, w.rate, w.batch_size, w.fill, t.coalesce, t.status,
                   rid_base=rank * w.requests, set_buf=cfg.buffers.set_buf, duration_s=w.duration_s,
                   burstiness=w.burstiness)


@dataclass(slots=True)
class Req:
    """One request's life on the prefill."""

    rid: int
    room: int
    inst: int
    t_arrive: float
    pad: tuple[int, int]
    dst_slot: int = -1
    src_slot: int = -1
    t_step: float = 0.0  # the forward step that finished it began
    t_taken: float = 0.0  # the decode took it: status in, readiness gate passed (decode's clock)
    t_ready: float = 0.0  # its row filled and digested
    t_landed: float = 0.0  # its write(s) finished
    t_status_out: float = 0.0  # its status sent
    t_status_in: float = 0.0  # its status read by the decode (decode's clock)
    set_buf_us: Optional[float] = None
    send_us: Optional[float] = None
    content: str = ""
    route: str = ""
    sent: bool = False
    done: bool = False
    verdict: Optional[tuple[Outcome, Detail, Optional[float]]] = None  # outcome, detail, t_verified


@dataclass
class Link:
    """One decode process (a TP rank of a decode instance) as this prefill sees it."""

    inst: int
    tp_rank: int
    push: zmq.Socket
    router: Any  # AuxRouter, or a FaultyRouter around it
    name: str = ""


@dataclass
class Instance:
    """One decode instance: its leader's control channel, and one link per TP rank."""

    index: int
    control: zmq.Socket
    links: list[Link] = field(default_factory=list)
    last_heard: float = 0.0
    told: float = 0.0  # when this process last sent its leader anything (the keepalive's clock)
    lost: bool = False
    owed: int = 0  # requests announced to it and not yet judged
    ungranted: int = 0  # announced, no slot yet: at most `slots` (backpressure)
    slots: int = 0  # the leader's buffer rows
    backlog: collections.deque = field(default_factory=collections.deque)  # arrived, not announced
    announce: list[list[int]] = field(default_factory=list)
    same_clock: bool = True
    auth: Any = None  # the session with its leader (orchestrator.transport.auth.Session)


@dataclass
class Step:
    reqs: list[Req]
    work: list[tuple[Link, list[Transfer], list[Send]]]  # per decode process: its sends
    started: bool = False  # the engine sends were submitted by the main thread already
    sends: list[tuple[Link, Send]] = field(default_factory=list)  # as they finished
    open: int = 0  # sends started and not finished
    sealed: Any = None  # the step's digest.Sealed, until its tags and fingerprints are read

    def take_seal(self) -> None:
        """The tags (for statuses) and fingerprints (for records) of the step's rows. Device
        rows: the transfer thread takes them before it starts the step's sends (the engine
        would wait for the same device work before reading the rows)."""
        if self.sealed is None:
            return
        tags, contents = self.sealed.result()
        self.sealed = None
        by_rid = {}
        for req, tag, content in zip(self.reqs, tags, contents):
            req.content = content
            by_rid[req.rid] = tag
        for _, transfers, _ in self.work:  # the tag travels in the status where rows have no kv_checksum
            for t in transfers:
                t.tag = by_rid[t.rid]


class Sender(threading.Thread):
    """The transfer thread: starts each step's sends as it comes (up to `max_inflight`
    writes in flight, as SGLang's transfer workers keep several), finishes them in order,
    sends each status behind its send, then wakes the main loop. Mooncake's calls release
    the GIL, so the scheduler thread fills the next step meanwhile."""

    def __init__(self, ctx: zmq.Context, wake_addr: str, log_decisions: Callable[[Step], None],
                 nap_s: float = 0.0, max_inflight: int = 16, device=None, spin: bool = False):
        super().__init__(name="sender", daemon=True)
        self.spin = spin  # endpoints.poll: wait for work by polling (GIL released in between)
        self.device = device
        self.queue: collections.deque[Optional[Step]] = collections.deque()
        self.done: collections.deque[Step] = collections.deque()
        self.ready = threading.Condition()
        self.wake = ctx.socket(zmq.PAIR)
        self.wake.connect(wake_addr)
        self.log_decisions = log_decisions
        self.nap_s = nap_s
        self.max_inflight = max_inflight
        self.inflight = 0  # sends started, not finished
        self.blocks_done = 0  # blocks of finished sends (written by this thread only)
        self.idle = False  # waiting for a step (a submit must notify)
        self.error: Optional[str] = None

    @property
    def backlog(self) -> int:
        """Steps handed over and not yet started."""
        return len(self.queue)

    def submit(self, step: Optional[Step]) -> None:
        with self.ready:
            self.queue.append(step)
            if self.idle:
                self.ready.notify()

    def run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        pending: collections.deque[tuple[Step, Link, list[Transfer], Send]] = collections.deque()
        closing = False
        try:
            while not (closing and not pending):
                if self.spin:
                    while not self.queue and not pending and not closing:
                        time.sleep(0)
                with self.ready:
                    while not self.queue and not pending and not closing:
                        self.idle = True
                        self.ready.wait()
                        self.idle = False
                    new = []
                    while self.queue and (self.inflight < self.max_inflight or not pending):
                        step = self.queue.popleft()
                        if step is None:
                            closing = True
                            break
                        new.append(step)
                for step in new:
                    self._start(step, pending)
                if pending:
                    self._finish_oldest(pending)
        except Exception as exc:  # noqa: BLE001 - reported by the main loop
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            try:
                self.wake.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        finally:
            self.wake.close(0)

    def _start(self, step: Step, pending) -> None:
        step.take_seal()  # tags before any status can go (a fault may send it at start)
        for link, transfers, sends in step.work:
            for send in sends:
                if not step.started:
                    link.router.start(send)
                pending.append((step, link, transfers, send))
                step.open += 1
                self.inflight += 1

    def _finish_oldest(self, pending) -> None:
        """Finish the oldest send that can be finished (in order, unless a send is held
        back: then the ones behind it go first)."""
        i = next((k for k, p in enumerate(pending) if p[1].router.ready(p[3])), None)
        if i is None:
            time.sleep(0 if self.spin else 50e-6)
            return
        step, link, transfers, send = pending[i]
        if self.nap_s:
            left = send.t0 + self.nap_s - time.monotonic()
            if left > 0:
                time.sleep(left)  # leave the core to Mooncake's transport threads meanwhile
        link.router.finish(send)
        del pending[i]
        self.inflight -= 1
        self.blocks_done += len(link.router.item_lens)
        link.router.after_send(send)
        send.t_status = time.monotonic()
        step.sends.append((link, send))
        step.open -= 1
        if not any(p[0] is step and p[1] is link for p in pending):
            link.router.after_step(transfers, send.per_step)
        if step.open == 0:
            first = not self.done
            self.done.append(step)
            if first:  # the main loop drains every finished step at once
                self.wake.send(b"", zmq.NOBLOCK)
            self.log_decisions(step)


@dataclass
class Credentials:
    """Who this prefill process is, this run: the hello's authenticator (the rest is per
    session), its nonce (in every session key and pad), the digest keys, its boot id."""

    auth: Authenticator
    nonce: str
    keys: Keys
    boot_id: str


@dataclass
class Dropped:
    """Control messages refused (bad MAC, undecodable) and replayed (not ours, or again)."""

    rejected: int = 0
    replayed: int = 0


class PrefillEndpoint:
    # the tag travels in the (authenticated) status even when the row carries it too: the
    # decode then tells a row written by someone else from one corrupted on the way
    TAG_IN_STATUS = True

    def __init__(self, cfg: OrchestratorConfig, plan: Plan, run_dir: Path, log, rank: int,
                 secret: bytes):
        self.cfg, self.plan, self.log, self.rank = cfg, plan, log, rank
        self.name = proc_name("prefill", rank, cfg.endpoints.prefill_ranks)
        self.side = build_side(cfg.buffers, cfg.layout, cfg.transport, plan, self.name, run_dir, log,
                               process_gpu(plan, "prefill", rank))
        self.layout = describe(self.buffers.specs)
        self.src = SlotAllocator(cfg.buffers.size)
        nonce = new_nonce()
        self.me = Credentials(Authenticator(secret), nonce, Keys(secret, nonce), boot_id())
        self.digest = RowDigest(self.buffers, self.me.keys, cfg.verify.digest)
        device_rows = self.buffers.device.type == "cuda"
        # buffers.set_buf=staged (a phase's choice): SGLang's set_buf into pinned host rows,
        # one upload a step (device rows; on host rows both modes are SGLang's set_buf)
        self.staged = StagedRows(self.buffers) if device_rows else None
        self.buffers.warm()  # start-up pays the device's first-use costs, not request 1
        self.digest.warm_seal(max(cfg.workload.batch_size, cfg.bench.batch_size), self.staged)
        # Mooncake's intra-node NVLink transport records an event on the submitting thread's
        # per-thread stream and waits for it before it copies; work on the legacy default
        # stream (torch's default) is ordered before that event, so a step's row writes land
        # before the engine reads them without a wait of ours (tests/test_gpu.py shows it).
        # Elsewhere the step syncs its stream once.
        self.engine_orders_writes = (
            device_rows and self.side.transport == "mooncake-nvlink_intra"
            and torch.cuda.current_stream(self.buffers.device).cuda_stream == 0)
        log.info("step_ordering", engine_orders_writes=self.engine_orders_writes,
                 set_buf=cfg.buffers.set_buf.value)
        self.pool = RequestPool(cfg.workload, shapes(cfg.buffers, self.buffers))
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.instances: list[Instance] = []
        self.dropped = Dropped()
        self.memory: dict[str, int] = {}
        self.stuck = False  # a Mooncake call that never returned: exit hard
        files, ranks = RunFiles(run_dir), cfg.endpoints.prefill_ranks
        static = {
            "mem_pool": plan.mem_pool.value, "buffer_device": plan.buffer_device.value,
            "route": plan.route.value, "reason": plan.route_reason.value,
            "transport": self.side.transport, "row_bytes": self.buffers.row_bytes,
            "fallback": plan.events[0].reason.value if plan.events else None,
        }
        self._decisions = DecisionLog(files.decisions(self.name, ranks), self.name, static)
        self.records_path = files.requests(self.name, ranks)
        self.records_path.write_text("")  # this process's records start here (phases append)
        self.wake = self.ctx.socket(zmq.PAIR)
        self.wake.bind(self.wake_addr)
        self.poller.register(self.wake, zmq.POLLIN)
        self._sender: Optional[Sender] = None

    @property
    def buffers(self):
        return self.side.buffers

    @property
    def sender(self) -> Sender:
        """The transfer thread (connect() starts it)."""
        assert self._sender is not None, "connect() first"
        return self._sender

    @property
    def timeout_s(self) -> float:
        return self.cfg.transport.timeout_s

    @property
    def wake_addr(self) -> str:
        """The main loop's wake-up socket (the transfer thread connects to it)."""
        return f"inproc://wake-{id(self)}"

    # ---- bootstrap ----------------------------------------------------------------------
    def connect(self, decodes: list[list[dict]]) -> None:
        """`decodes[i][t]`: what decode instance i's TP rank t said when it came up (its
        control and data endpoints). Says hello to every rank, learns its engine session,
        buffer pointers and layout, and keeps the leader's control channel for arrivals,
        grants and verdicts."""
        self.bulk_ptr = decodes[0][0].get("bulk_ptr")  # the benchmark's bandwidth target
        for i, ranks in enumerate(decodes):
            inst: Optional[Instance] = None
            for t, info in enumerate(ranks):
                ctl = new_socket(self.ctx, zmq.DEALER, self.timeout_s)
                ctl.connect(info["control_endpoint"])
                push = new_socket(self.ctx, zmq.PUSH, self.timeout_s)
                push.connect(info["data_endpoint"])
                router = AuxRouter(self.plan, self.buffers, self.me.auth, self.rank, self.side.engine, push,
                                   max_blocks_per_batch=self.cfg.transport.mooncake.max_blocks_per_batch,
                                   tag_in_status=self.TAG_IN_STATUS)
                name = proc_name("decode", i, len(decodes), t, len(ranks))
                if inst is None:
                    inst = Instance(i, ctl)
                    self.poller.register(ctl, zmq.POLLIN)
                inst.links.append(Link(i, t, push, wrap(router, self.cfg.faults), name))
                self._bootstrap(inst, inst.links[-1], ctl, info.get("advertised"))
                if t > 0:
                    ctl.close(0)
            assert inst is not None, "an instance has at least one rank"
            self.instances.append(inst)
        spin = self.cfg.endpoints.poll.spins()
        nap_s = (self.cfg.transport.mooncake.nap_us / 1e6
                 if self.plan.completion is CompletionSetting.nap else 0.0)
        self._sender = Sender(self.ctx, self.wake_addr, self._log_decisions, nap_s,
                             self.cfg.transport.max_inflight_sends, self.buffers.device, spin)
        self.log.info("prefill_loop", transfer_thread="spin" if spin else "block")
        self._sender.start()

    def _bootstrap(self, inst: Instance, link: Link, ctl: zmq.Socket, advertised: Optional[dict] = None) -> None:
        me = self.me
        ctl.send(me.auth.seal(wire.encode("hello", rank=self.rank, layout=self.layout,
                                           fingerprint=fingerprint(self.layout), nonce=me.nonce,
                                           pid_ns=pid_namespace(), boot_id=me.boot_id)))
        msg = self._recv_one(ctl, link.name)
        if msg.get("type") == "error":
            raise LayoutMismatch(f"{link.name} refused bootstrap: {msg['detail']}")
        if msg.get("type") != "bootstrap" or msg["tp_rank"] != link.tp_rank:
            raise RuntimeError(f"{link.name} answered hello with {msg}")
        diff = first_difference(self.layout, msg["layout"])
        if diff is not None:
            raise LayoutMismatch(f"layout mismatch with {link.name}: {diff}")
        why = same_process_space_rule(self.plan.engine_transport, (pid_namespace(), me.boot_id),
                                      (msg.get("pid_ns", ""), msg["boot_id"]))
        if why is not None:  # before any byte moves
            raise LayoutMismatch(f"{link.name} refused: {why}")
        session = me.auth.session(self.rank, me.nonce, msg["nonce"], "prefill")
        peer = Peer(msg["session_id"], msg["aux_ptrs"], msg["item_lens"], msg["slots"],
                    msg["tp_rank"], msg["boot_id"], msg["scratch_ptr"], auth=session)
        link.router.connect(peer)
        if link.tp_rank == 0:
            inst.slots = peer.slots
            inst.auth = session
        inst.same_clock = inst.same_clock and bool(me.boot_id) and peer.boot_id == me.boot_id
        engine = self.side.engine
        warm_s = self._probe_bounded(engine, link.router, advertised) if engine is not None else 0.0
        self.log.info("bootstrapped", decode=link.name, peer_session=peer.session_id,
                      peer_pid_ns=msg.get("pid_ns", ""), pid_ns=pid_namespace(),
                      slots=peer.slots, same_clock=inst.same_clock, first_write_us=round(warm_s * 1e6, 1))

    def _recv_one(self, ctl: zmq.Socket, name: str) -> dict:
        deadline = _clock() + self.timeout_s
        while True:
            left = deadline - _clock()
            if left <= 0 or not ctl.poll(int(left * 1000)):
                raise TimeoutError(f"{name} did not answer hello within "
                                   f"transport.timeout_s={self.timeout_s:g}")
            msg = self._open(ctl.recv_multipart())
            if msg and msg.get("type") == "bootstrap" and msg["hello_nonce"] != self.me.nonce:
                self.dropped.replayed += 1  # an answer to another hello (another run's): not ours
                self.log.warning("bootstrap_replayed", decode=name)
                continue
            if msg:
                return msg

    def _probe_bounded(self, engine: MooncakeEngine, router, advertised: Optional[dict] = None) -> float:
        """Mooncake's handshake with a peer that accepts and never answers blocks ~60 s and
        ignores its timeout variables: run it on a watchdog of transport.timeout_s. Then the
        router's warm-up write, on the same watchdog; returns its seconds. `advertised`: the
        address SGLang would advertise on the decode's host (a split run's bootstrap, once its
        ZMQ probe answered): Mooncake's send_probe towards the same handshake port there."""
        result: dict = {}
        session = router.peer_session()
        host, _, port = session.rpartition(":")
        elsewhere = (advertised is not None and advertised.get("address") not in (None, "", host)
                     and engine.can_probe)

        def probe() -> None:
            result["ok"] = engine.probe(session)
            if not result["ok"]:
                return
            if elsewhere:
                assert advertised is not None
                result["advertised_ok"] = engine.probe(f"{advertised['address']}:{port}")
            if self.buffers.device.type == "cuda":
                import torch

                torch.cuda.set_device(self.buffers.device)  # a new thread starts on device 0
            try:
                result["warm_s"] = router.warm()
            except EngineError as exc:
                result["warm_error"] = str(exc)

        t = threading.Thread(target=probe, daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self.stuck = True
            raise TimeoutError(f"Mooncake handshake with decode session {session} did not finish "
                               f"within transport.timeout_s={self.timeout_s:g}: its engine listener "
                               f"{session} stalled (Mooncake serves handshakes one at a time, and "
                               "idle connections to that port from anyone hold it)")
        if not result.get("ok"):
            raise RuntimeError(f"Mooncake probe of decode session {session} failed")
        if elsewhere and not result.get("advertised_ok"):
            from orchestrator.handoff.transport.reach import unreachable
            from orchestrator.profile.config import AddressCheck

            assert advertised is not None
            line = unreachable("decode", advertised, f"Mooncake send_probe to {advertised['address']}:{port} "
                                                     "failed (its ZMQ probe had answered)")
            if self.cfg.transport.address_check is AddressCheck.fail:
                raise RuntimeError(line)
            self.log.warning("peer_address_unreachable", detail=line)
        elif elsewhere and advertised is not None:
            self.log.info("peer_address_mooncake_probe", session=f"{advertised['address']}:{port}", ok=True)
        if "warm_error" in result:
            raise RuntimeError(f"the warm-up write to decode session {session} failed: "
                               f"{result['warm_error']}")
        return result["warm_s"]

    # ---- messages -----------------------------------------------------------------------
    def _send(self, inst: Instance, payload: bytes) -> None:
        inst.control.send((inst.auth or self.me.auth).seal(payload))
        inst.told = _clock()

    def _open(self, frames: list[bytes], auth=None) -> dict:
        try:
            body = (auth or self.me.auth).unseal(frames[0]) if len(frames) == 1 else None
        except Replayed as exc:
            self.dropped.replayed += 1
            self.log.warning("control_replayed", error=str(exc))
            return {}
        if body is None:
            self.dropped.rejected += 1
            self.log.warning("control_rejected", reason="bad or missing MAC", frames=len(frames))
            return {}
        try:
            return wire.decode(body)
        except wire.WireError as exc:
            self.dropped.rejected += 1
            self.log.warning("control_dropped", error=str(exc))
            return {}

    def _log_decisions(self, step: Step) -> None:
        """One route_decision line per request and decode process, a step's in one write
        (transfer thread)."""
        lines = []
        for link, send in step.sends:
            shape = {"requests": len(send.transfers), "blocks": send.blocks, "bytes": send.nbytes}
            outcome, latency = "ok" if send.error is None else "error", round(send.latency_us, 2)
            for t in send.transfers:
                lines.append({"rank": self.rank, "rid": t.rid, "room": t.room, "slot": t.src_slot,
                              "dst_slot": t.dst_slot, "decode": link.name, "send": shape,
                              "latency_us": latency, "outcome": outcome, "error": send.error})
        self._decisions.write(lines)

    # ---- the workload -------------------------------------------------------------------
    def fill_ahead(self) -> None:
        """workload.fill=ahead: every slot's row once, from a distinct synthetic request."""
        for slot in range(self.buffers.size):
            self.buffers.set_buf(self.pool.get(slot, slot))
        self.buffers.sync()
        self.digest.freeze()

    def run(self, phase: Phase, conn, faults: Optional[LoopFaults] = None) -> RankResult:
        """Run one phase to the end; returns what it measured. `faults`: the fault hooks
        with the runner to ask (default: the configured fault's, its checkpoint unarmed)."""
        return _Loop(self, phase, conn, faults or LoopFaults(self.cfg.faults, self.rank)).run()

    def close(self) -> None:
        if self._sender is not None and self._sender.is_alive():
            self._sender.submit(None)
            self._sender.join(self.timeout_s)
            if self._sender.is_alive():  # blocked inside the engine (an unreachable peer)
                self.log.warning("sender_stuck", detail="a write never returned from the engine")
                self.stuck = True
                return
        for inst in self.instances:
            try:
                self._send(inst, wire.encode("bye"))
            except zmq.ZMQError:
                pass
            inst.control.close(0)
            for link in inst.links:
                link.push.close(0)
        self.wake.close(0)
        self._decisions.close()
        self.ctx.term()


class _Loop:
    """The main loop of one phase (kept apart so the endpoint's set-up is reusable)."""

    def __init__(self, ep: PrefillEndpoint, phase: Phase, conn, faults: LoopFaults):
        self.ep, self.phase, self.conn, self.faults = ep, phase, conn, faults
        self.w = w = ep.cfg.workload
        self.total = phase.requests
        self.offsets = arrival_offsets(phase.rate, w.seed, phase.requests, ep.rank, phase.burstiness,
                                       phase.duration_s)
        if self.offsets is not None:  # (with a duration: the arrivals it holds)
            self.total = len(self.offsets)
        self.res = RankResult(ep.rank, self.total, row_bytes=ep.buffers.row_bytes)
        # a closed loop's workload.duration_s: the clock (set at the start) that ends its arrivals
        self.deadline: Optional[float] = None
        if phase.duration_s is not None:
            hit = self.offsets is not None and self.total == phase.requests
            self.res.ended_by = "requests" if hit else "duration"
        self.outstanding: dict[int, Req] = {}
        self.ready: collections.deque[Req] = collections.deque()
        self.next_i = 0
        self.finished = 0
        self.stopping = False
        self.more_now = False  # issue() stopped at its budget with arrivals due now
        self.sink = open(ep.records_path, "a", buffering=1 << 16)
        self.route = ep.plan.route.value
        self.warm = min(1000, self.total // 10)
        links = max(len(inst.links) for inst in ep.instances)
        self.blocks_per_request = len(ep.buffers.specs) * links  # one block per field per rank
        self.blocks_out = ep.sender.blocks_done  # blocks handed to the engine so far
        self.staged = ep.staged if phase.set_buf is SetBufMode.staged else None
        if self.staged is not None:
            self.staged.take(ep.buffers)  # earlier phases may have written the device rows

    # ---- request lifecycle ------------------------------------------------------------------
    def arrive(self, i: int, t_arrive: float) -> None:
        ep = self.ep
        rid = self.phase.rid_base + i
        inst = ep.instances[decode_of(rid, len(ep.instances))]
        room = room_of(self.w, rid)
        req = Req(rid, room, inst.index, t_arrive, ep.me.keys.pad(ep.rank, rid))
        if inst.lost:
            req.verdict = (Outcome.failed, Detail.not_sent_peer_lost, None)
            self.finish(req)
            return
        self.outstanding[rid] = req
        inst.backlog.append(req)

    def flush_arrivals(self) -> None:
        """Announce arrivals, at most as many ungranted at a time as the decode has slots
        (the rest wait here, their latency still counted from arrival)."""
        for inst in self.ep.instances:
            while inst.backlog and inst.ungranted < inst.slots:
                req = inst.backlog.popleft()
                if req.verdict is not None:
                    continue
                inst.owed += 1
                inst.ungranted += 1
                inst.announce.append([req.rid, req.room])
            if inst.announce:
                if not inst.owed - len(inst.announce):
                    inst.last_heard = _clock()  # nothing was owed before: the clock starts now
                self.ep._send(inst, wire.encode("arrive", reqs=inst.announce,
                                                contiguous=self.phase.coalesce))
                inst.announce = []

    def form_step(self) -> None:
        """One forward step: fill (inline) and seal the step's rows, hand its sends over.
        Device rows: the seal is one graph replay and the step waits at most once (the
        engine's own wait where it orders our writes, else one stream sync)."""
        ep, b = self.ep, self.ep.buffers
        k = min(self.phase.batch_size, len(self.ready), ep.src.available)
        if self.phase.coalesce:
            slots = ep.src.alloc_run(k)
        else:
            slots = [s for _ in range(k) if (s := ep.src.alloc()) is not None]  # k <= available: all are
        reqs = [self.ready.popleft() for _ in slots]
        t_step = _clock()
        pc = time.perf_counter
        idents, pads, rooms = [(ep.rank, r.rid) for r in reqs], [r.pad for r in reqs], [r.room for r in reqs]
        staged = None
        if self.phase.fill is FillMode.inline:
            staged = self.staged
            target = staged or b
            for req, slot in zip(reqs, slots):
                r = ep.pool.get(req.rid, slot)
                t0 = pc()
                target.set_buf(r)
                req.set_buf_us = (pc() - t0) * 1e6
        sealed = ep.digest.seal(slots, rooms, pads, idents, rows=staged,
                                ahead=self.phase.fill is FillMode.ahead)
        if staged is not None:  # each request's share of packing the step's rows
            share = sealed.pack_s * 1e6 / len(reqs)
            for req in reqs:
                req.set_buf_us += share
        if not ep.engine_orders_writes:
            b.sync()
        per_link: dict[int, tuple[Link, list[Transfer]]] = {}
        for req, slot in zip(reqs, slots):
            req.src_slot, req.t_step, req.route = slot, t_step, self.route
            inst = ep.instances[req.inst]
            for link in inst.links:
                per_link.setdefault(id(link), (link, []))[1].append(
                    Transfer(req.rid, req.room, slot, req.dst_slot))
        ph = self.phase
        work = [(link, transfers, link.router.sends(transfers, ph.coalesce, ph.status))
                for link, transfers in per_link.values()]
        self.blocks_out += sum(len(sends) * len(link.router.item_lens) for link, _, sends in work)
        step = Step(reqs, work, sealed=sealed)
        if sealed.ready:  # host rows: the tags are known now
            step.take_seal()
        t_ready = _clock()
        for req in reqs:
            req.t_ready = t_ready
        # Rows sealed on the host side (host rows; fill=ahead, signed on the host): submitted
        # here, the write starts before any thread hop. Rows still being sealed on the device:
        # the transfer thread submits, so the engine's wait for that device work is not the
        # scheduler thread's (it fills the next step meanwhile).
        if step.sealed is None and all(link.router.starts_in_caller for link, _, _ in work):
            for link, _, sends in work:
                for send in sends:
                    link.router.start(send)
            step.started = True
        ep.sender.submit(step)

    def sent(self, step: Step) -> None:
        """The transfer thread finished a step: free its source slots, note send times."""
        by_rid = {r.rid: r for r in step.reqs}
        for _, send in step.sends:
            self.res.sends += 1
            self.res.send_blocks += send.blocks
            for t in send.transfers:
                req = by_rid[t.rid]
                req.send_us = max(req.send_us or 0.0, send.latency_us)
                req.t_landed = max(req.t_landed, send.t0 + send.latency_us / 1e6)
                req.t_status_out = max(req.t_status_out, send.t_status)
        for req in step.reqs:
            self.ep.src.free(req.src_slot)
            req.sent = True
            if req.verdict is not None:
                self.finish(req)

    def judged(self, inst: Instance, verdicts: list[list[int]]) -> None:
        """Verdicts are taken only for a request in the state that expects one: judged
        (verified, corrupted or failed) once this prefill handed its row to the transfer
        thread (its status goes out behind the write); failed unsent only while it waits
        for a slot (the decode shed it). Anything else is counted and changes nothing."""
        now = _clock()
        for rid, outcome, detail, t_ns, t_status_ns, t_taken_ns in verdicts:
            req = self.outstanding.get(rid)
            if req is None or req.inst != inst.index or req.verdict is not None:
                self.res.rejected += 1  # not ours, or judged twice (late, after a stop or a loss)
                continue
            try:
                o, d = Outcome.of(outcome), Detail.of(detail)
            except KeyError:
                self.res.rejected += 1
                continue
            if (req.src_slot < 0 if req.dst_slot >= 0 else o is not Outcome.failed):
                self.res.replayed += 1  # a verdict for a row not sent yet
                self.ep.log.warning("verdict_out_of_state", rid=rid, granted=req.dst_slot >= 0,
                                    outcome=o.value)
                continue
            t_verified = t_ns / 1e9 if inst.same_clock else now
            req.verdict = (o, d, t_verified)
            req.t_status_in = t_status_ns / 1e9 if inst.same_clock else 0.0
            req.t_taken = t_taken_ns / 1e9 if inst.same_clock and t_taken_ns else 0.0
            inst.owed -= 1
            if req.dst_slot < 0:
                inst.ungranted -= 1
            if req.sent or req.src_slot < 0:
                self.finish(req)
            else:  # judged before its send finished (a held send may go now)
                for link in inst.links:
                    link.router.judged(rid)

    def finish(self, req: Req) -> None:
        if req.done:
            return
        req.done = True
        assert req.verdict is not None, "finished once judged"
        outcome, detail, t_verified = req.verdict
        self.outstanding.pop(req.rid, None)
        t_v = t_verified if outcome is Outcome.verified else None  # a verified handoff's time
        rec = Record(
            req.rid, req.room, req.inst, req.dst_slot, req.route,
            _r(req.set_buf_us), _r(req.send_us),
            _r((t_v - req.t_step) * 1e6) if t_v is not None and req.t_step else None,
            _r((t_v - req.t_arrive) * 1e6) if t_v is not None else None,
            outcome, detail, req.content,
            self.faults.label(req.rid),
            taken_us=(_r((req.t_taken - req.t_step) * 1e6)
                      if t_v is not None and req.t_taken and req.t_step else None),
            t_verdict=_clock())
        self.res.add(rec)
        if t_v is not None and req.t_status_in and req.t_step:
            self.res.add_stages(req.t_step, req.t_ready, req.t_landed, req.t_status_out,
                                req.t_status_in, t_v)
        self.sink.write(rec.line() + "\n")
        self.finished += 1
        if self.finished == self.warm:
            self.ep.memory["rss_kb_warm"] = rss_kb()

    def lose(self, inst: Instance, detail: Detail, why: str) -> None:
        """Fail everything an instance still owes us, now: a write to it may stay in the
        engine's hands until the engine gives up on the host (its source row is freed when
        the write returns; the record does not wait for it)."""
        inst.lost = True
        self.res.lost[inst.index] = why
        self.ep.log.error("peer_lost", decode=inst.index, detail=why, owed=inst.owed)
        for req in list(self.outstanding.values()):
            if req.inst == inst.index and req.verdict is None:
                req.verdict = (Outcome.failed, detail, None)
                self.finish(req)
        self.ready = collections.deque(r for r in self.ready if r.inst != inst.index)
        inst.backlog.clear()
        inst.owed = inst.ungranted = 0

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> RankResult:
        ep, phase = self.ep, self.phase
        if phase.fill is FillMode.ahead:
            ep.fill_ahead()
        t0 = _clock()
        self.res.t_start = t0
        if self.phase.duration_s is not None and self.offsets is None:
            self.deadline = t0 + self.phase.duration_s
        self.res.clock = "one_way" if all(i.same_clock for i in ep.instances) else "round_trip"
        for inst in ep.instances:
            inst.last_heard = t0
        last_progress = last_iter = t0
        conn_fd = self.conn.fileno() if self.conn is not None else None
        if conn_fd is not None:
            ep.poller.register(conn_fd, zmq.POLLIN)
        try:
            while self.finished < self.total:
                now = _clock()
                if now - last_iter > ep.timeout_s / 2:  # WE were stalled: nobody owed us anything
                    for inst in ep.instances:
                        inst.last_heard = now
                last_iter = now
                self.issue(now, t0)
                while self.can_form():
                    self.form_step()
                wait = self.wait_ms(now, t0)
                events = dict(ep.poller.poll(wait))
                if ep.wake in events:
                    while True:
                        try:
                            ep.wake.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                if ep.sender.error:
                    raise RuntimeError(f"transfer thread failed: {ep.sender.error}")
                while ep.sender.done:
                    self.sent(ep.sender.done.popleft())
                for inst in ep.instances:
                    if inst.control in events:
                        self.drain(inst)
                if conn_fd is not None and conn_fd in events and self.conn.poll():
                    self.from_runner()
                if Stop.requested and not self.stopping:
                    self.stop(Detail.interrupted)
                now = _clock()
                self.silent_decodes(now)
                self.keepalive(now)
                self.faults.progress(self.finished, len(self.outstanding))
                if self.conn is not None and now - last_progress >= 0.25:
                    self.conn.send(protocol.Progress(finished=self.finished, verified=self.res.verified))
                    last_progress = now
        finally:
            if conn_fd is not None:
                ep.poller.unregister(conn_fd)
        ep.memory["rss_kb_end"] = rss_kb()
        self.res.memory = dict(ep.memory)
        self.res.rejected += ep.dropped.rejected
        self.res.replayed += ep.dropped.replayed
        self.sink.close()
        return self.res

    def from_runner(self) -> None:
        """A message from the runner: stop, or a decode instance is gone (it saw it exit)."""
        match self.conn.recv():
            case protocol.Stop():
                self.stop(Detail.interrupted)
            case protocol.DecodeGone(index=index, why=why):
                inst = self.ep.instances[index]
                if not inst.lost:
                    self.lose(inst, Detail.decode_lost, why)

    def silent_decodes(self, now: float) -> None:
        """A decode instance that owes answers and sent nothing for transport.timeout_s is lost."""
        ep = self.ep
        for inst in ep.instances:
            if not inst.lost and inst.owed > 0 and now - inst.last_heard > ep.timeout_s:
                self.drain(inst)  # whatever already arrived counts first
                if inst.owed > 0 and now - inst.last_heard > ep.timeout_s:
                    self.lose(inst, Detail.peer_lost,
                              f"decode silent for transport.timeout_s={ep.timeout_s:g}")

    def keepalive(self, now: float) -> None:
        """An empty arrive to every live instance told nothing for a heartbeat interval."""
        ep = self.ep
        every = heartbeat_s(ep.timeout_s)
        for inst in ep.instances:
            if not inst.lost and now - inst.told >= every:
                ep._send(inst, wire.encode("arrive", reqs=[], contiguous=self.phase.coalesce))

    def end_arrivals(self) -> None:
        """A closed loop's workload.duration_s ran out: what arrived is the phase's count."""
        self.deadline = None
        self.total = self.res.requests = self.next_i

    def issue(self, now: float, t0: float) -> None:
        if self.stopping:
            return
        if self.deadline is not None and now >= self.deadline:
            self.end_arrivals()
        holds = self.faults.holds
        # at most ISSUE_BUDGET arrivals per pass: with a decode lost, each fails at once and the
        # rest of the phase would pass here without the loop reporting progress to the runner
        end = min(self.total, self.next_i + ISSUE_BUDGET)
        if self.offsets is None:
            while (self.next_i < end and len(self.outstanding) < self.phase.concurrency
                   and not holds(self.next_i)):
                self.arrive(self.next_i, now)
                self.next_i += 1
            self.more_now = self.next_i == end < self.total
            if self.deadline is not None and self.next_i == self.total:
                self.res.ended_by = "requests"  # the ceiling came before the clock
        else:
            while (self.next_i < self.total and t0 + self.offsets[self.next_i] <= now
                   and not holds(self.next_i)):
                self.arrive(self.next_i, t0 + float(self.offsets[self.next_i]))
                self.next_i += 1
        self.flush_arrivals()

    def can_form(self) -> bool:
        """A step may form: requests ready, source rows free, the transfer thread not behind,
        and the engine's queue not past transport.max_inflight_blocks with this step (one
        step always may when nothing is in flight)."""
        ep = self.ep
        if not (self.ready and ep.src.available and ep.sender.backlog < 2):
            return False
        out = self.blocks_out - ep.sender.blocks_done
        rows = 1 if self.phase.coalesce else min(self.phase.batch_size, len(self.ready))
        step = rows * self.blocks_per_request  # a coalesced step is about one run per rank
        return out == 0 or out + step <= ep.cfg.transport.max_inflight_blocks

    def wait_ms(self, now: float, t0: float) -> int:
        if self.can_form() or self.more_now:
            return 0
        if self.offsets is not None and self.next_i < self.total and not self.stopping:
            return max(0, min(50, int((t0 + self.offsets[self.next_i] - now) * 1000)))
        return 50

    def drain(self, inst: Instance) -> None:
        """Every control message that has already arrived from this instance."""
        while True:
            try:
                frames = inst.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.ep._open(frames, inst.auth)
            if not msg:
                continue
            inst.last_heard = _clock()
            kind = msg["type"]
            if kind == "update":
                for rid, slot in msg["grants"]:
                    req = self.outstanding.get(rid)
                    if req is None or req.inst != inst.index or req.verdict is not None:
                        self.res.rejected += 1  # not ours, or already done
                        continue
                    if req.dst_slot >= 0:
                        self.res.replayed += 1  # a second grant for one request
                        continue
                    req.dst_slot = slot
                    inst.ungranted -= 1
                    self.ready.append(req)
                self.judged(inst, msg["v"])
            elif kind == "error":
                self.ep.log.error("decode_error", decode=inst.index, detail=msg["detail"])
            else:
                self.res.rejected += 1

    def stop(self, detail: Detail) -> None:
        """Interrupted: announce nothing more, give what is in flight a moment, then fail
        the rest with a reason."""
        self.stopping = True
        self.res.interrupted = True
        deadline = _clock() + 0.3
        while self.outstanding and _clock() < deadline:
            events = dict(self.ep.poller.poll(20))
            while self.ep.sender.done:
                self.sent(self.ep.sender.done.popleft())
            for inst in self.ep.instances:
                if inst.control in events:
                    self.drain(inst)
        for req in list(self.outstanding.values()):
            if req.verdict is None:
                req.verdict = (Outcome.failed, detail, None)
                self.finish(req)
        if self.deadline is not None:  # a duration's ceiling was never a count to start
            self.end_arrivals()
        self.skip_unarrived()

    def skip_unarrived(self) -> None:
        """Requests that never arrived are not_started: counted, never failed, and given no
        line in requests.jsonl (an interrupted run may leave most of its requests here)."""
        n = self.total - self.next_i
        self.res.not_started += n
        self.finished += n
        self.next_i = self.total


def _r(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 2)


def workload_driver(endpoint: PrefillEndpoint, conn: protocol.Channel) -> RankResult:
    """The default driver: the configured workload, once."""
    cfg = endpoint.cfg
    faults = LoopFaults(cfg.faults, endpoint.rank, lambda kind: _ask_runner(conn, kind))
    return endpoint.run(Phase.of(cfg, endpoint.rank), conn, faults)


def _ask_runner(conn: protocol.Channel, kind: str) -> None:
    """A process fault: the runner acts (kill, stop) and answers; wait for it."""
    conn.send(protocol.FaultReached(kind=kind))
    while not isinstance(conn.recv(), protocol.FaultDone):
        pass


def prefill_main(cfg: OrchestratorConfig, plan: Plan, run_dir: str, secret: bytes, conn,
                 rank: int = 0, driver=workload_driver) -> None:
    """Process entry (multiprocessing spawn) of prefill rank `rank`: build buffers and
    engine (in parallel with the decode side), wait for the decode endpoints, bootstrap,
    run `driver(endpoint, conn)` and send back what it returns. `conn` is this process's
    end of the runner's pipe; it carries protocol messages only."""
    conn = protocol.Channel(conn)
    run_path = Path(run_dir)
    name = proc_name("prefill", rank, cfg.endpoints.prefill_ranks)
    log = start_process(name, run_path, cfg.logging.console)
    endpoint = None
    try:
        endpoint = PrefillEndpoint(cfg, plan, run_path, log, rank, secret)
        conn.send(protocol.Up(transport=endpoint.side.transport))
        msg = conn.recv()
        if not isinstance(msg, protocol.Decodes):
            return  # the run ended before it started (a stop, or a refused bootstrap)
        endpoint.connect(msg.infos)
        conn.send(protocol.Running())
        conn.send(protocol.Result(result=driver(endpoint, conn)))
    except Exception as exc:
        conn.send(protocol.Error(line=report_failure(log, "prefill_failed", exc)))
    finally:
        if endpoint is not None and not endpoint.stuck:
            endpoint.close()  # sets `stuck` if the transfer thread never comes back
        if endpoint is not None and endpoint.stuck:
            import os

            os._exit(1)  # a Mooncake call is still blocked inside the engine: do not wait on it
