"""Decode endpoint (receiver): grants a slot when a request arrives, lands tcp-route rows,
takes "KV done" statuses, and judges every request that has one in batches: the readiness
gate, the room, and the digest of every byte, in one pass over the rows on their device.
Verdicts go back in one message per prefill per step. Freed slots have their room zeroed.

Readiness gate (SGLang PR 26394 and follow-ups), as config (gate.*):
  readiness          "done" counts as "transferring" while the slot's room is still 0
                     (re-checked every step until transport.timeout_s, then failed);
  zero_room_on_free  a freed slot's room is zeroed, so the previous tenant's room can never
                     pass for the next one's.

A decode instance of several TP ranks (endpoints.decode_tp) runs one of these per rank:
every rank receives every request's aux and status into its own buffers; the leader (rank
0) also runs the control channel and tells the others about new grants; each step the ranks
all-reduce (MIN) their poll status per request and act only on what they agree on
(orchestrator.handoff.endpoints.tp). One step, on one rank or many: poll -> agree on the polls ->
judge -> agree on the verdicts -> finish; a single rank's agreement is its own input.

Requests are identified by (prefill rank, request id), never by room alone.

Control identity is a session, not a message: the first authentic hello for a prefill rank
binds that rank to its connection (the ROUTER identity) and opens a Session keyed with both
processes' per-run nonces (orchestrator.handoff.transport.auth). Another hello for a bound rank, from any
connection, is refused and counted (`hijack_refused`); every later message of that rank,
control or data, must open under its session's keys. Replays inside the session (a control
message seen before, a status for a request already judged or with a status) are counted
(`replayed`) and change nothing. The leader also tells every bound prefill that it is
alive when it has had nothing to say for a while (an empty update), so a prefill whose
requests wait behind a stalled sibling's never takes this decode for lost.

Where the parts live: the hello in endpoints.handshake, the control plane in
endpoints.decode_control, the data plane in endpoints.decode_data, slots and updates in
endpoints.grants, the step in endpoints.decode_step, reading and judging rows in
endpoints.judge, what the process keeps in endpoints.decode_state; this module builds them
from the process's spec (orchestrator.handoff.specs.DecodeSpec). The process's entry, which
speaks the runner's pipe around it, is orchestrator.job.children.decode_main.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, cast

import structlog
import torch
import zmq
from zmq.backend import zmq_poll

from orchestrator.handoff.buffers import MetadataBuffers, SlotAllocator
from orchestrator.handoff.digest import RowDigest
from orchestrator.handoff.endpoints import control
from orchestrator.handoff.endpoints.common import Shutdown, bind_random, build_side, new_socket, process_gpu, rss_kb
from orchestrator.handoff.endpoints.decode_control import Control
from orchestrator.handoff.endpoints.decode_data import DataPlane
from orchestrator.handoff.endpoints.decode_state import Drops, Ledger, Notices, Peers, Replies
from orchestrator.handoff.endpoints.decode_step import Stepper
from orchestrator.handoff.endpoints.grants import Grants
from orchestrator.handoff.endpoints.handshake import DecodeHandshake, Offer
from orchestrator.handoff.endpoints.judge import Judge, Rows
from orchestrator.handoff.endpoints.load import ForwardLoop
from orchestrator.handoff.endpoints.tp import Group, TorchGroup, single
from orchestrator.handoff.faults import decode_setup, silent_session
from orchestrator.handoff.specs import DecodeSpec, FaultSpec
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.advert import DecodeAdvert
from orchestrator.profile.layout import describe
from orchestrator.profile.platform import clock as _clock
from orchestrator.profile.platform import usable_cores
from orchestrator.results.records import DecodeResult
from orchestrator.results.rundir import RunFile, RunFiles, proc_name

IDLE_MS = 50  # the longest a pass sleeps in the poll
_POLLIN, _EVENTS, _NOBLOCK = int(zmq.POLLIN), int(zmq.EVENTS), int(zmq.NOBLOCK)


def poll_wait_ms(busy: bool, held: bool, due: float, now: float) -> int:
    """How long a pass of the decode's loop sleeps in its poll: never when it spins (or a
    forward loop runs); 1 ms while the readiness gate holds a request (re-checked every
    step) or a TP group steps; else until the timers are `due`, at most IDLE_MS (a SIGTERM's
    flag is seen within it), at least 1 ms."""
    if busy:
        return 0
    if held:
        return 1
    return max(1, min(IDLE_MS, int((due - now) * 1e3) + 1))


def _drain(sock: zmq.Socket, handle: Callable[[list[bytes]], None], most: int) -> None:
    """Up to `most` messages off a socket the poll found readable (no zmq.Again raised per
    drain: whether more wait is asked after each)."""
    for _ in range(most):
        try:
            frames = sock.recv_multipart(_NOBLOCK)
        except zmq.Again:
            return
        handle(frames)
        if not cast(int, sock.get(_EVENTS)) & _POLLIN:
            return


class Sockets:
    """The control (ROUTER) and data (PULL) sockets, on random ports of transport.host, and
    the silent_peer fault's listener (the engine session advertised instead of the real one)."""

    def __init__(self, host: str, timeout_s: float, faults: FaultSpec, max_frame_bytes: int):
        self.silent = silent_session(faults, host)
        self.ctx = zmq.Context()
        self.control = new_socket(self.ctx, zmq.ROUTER, timeout_s)
        self.data = new_socket(self.ctx, zmq.PULL, timeout_s, max_frame_bytes)
        self.control_endpoint = bind_random(self.control, host)
        self.data_endpoint = bind_random(self.data, host)

    def close(self) -> None:
        if self.silent is not None:
            self.silent.close()
        self.control.close(0)
        self.data.close(0)
        self.ctx.term()


def _forward_loop(spec: DecodeSpec, buffers: MetadataBuffers, host_rows: bool, index: int,
                  log: structlog.stdlib.BoundLogger) -> Optional[ForwardLoop]:
    """endpoints.decode_load: the forward loop on the decode GPU (None when off, or with no
    CUDA device: then with a warning). `index`: this process among the decode processes."""
    d = spec.load
    if d.step_ms <= 0:
        return None
    # the decode GPU decodes whatever the aux rows' device: host rows (the gate reads
    # host memory) against CUDA rows (it reads behind the queued forward)
    gpu = buffers.device if not host_rows else (
        torch.device("cuda", d.gpus[index % len(d.gpus)]) if torch.cuda.is_available() else None)
    if gpu is None:
        log.warning("decode_load_off", detail="endpoints.decode_load needs a CUDA device: "
                    "none here, running without a forward loop")
        return None
    torch.cuda.set_device(gpu)  # host rows: this process's only CUDA work
    with torch.cuda.device(gpu):
        load = ForwardLoop(gpu, d.step_ms)
        load.measure_idle(d.idle_s)  # before serving: no handoffs
    log.info("decode_load", step_ms=d.step_ms, device=str(gpu),
             matmuls_per_step=load.matmuls, gate_read=spec.gate.read.value,
             forward_steps_per_s_idle=load.idle_per_s)
    return load


class DecodeEndpoint:
    """One decode process: its buffers and engine, and the parts that serve them (the
    control and data planes, the grants, the step), wired here; serve() is its loop."""

    def __init__(self, spec: DecodeSpec, run_dir: Path, log: structlog.stdlib.BoundLogger, secret: bytes,
                 instance: int = 0, tp_rank: int = 0, group: Optional[Group] = None):
        plan = self.plan = spec.plan
        self.spec, self.log = spec, log
        self.name = proc_name("decode", instance, spec.ranks, tp_rank, spec.tp)
        self.tp_rank = tp_rank
        self.side = build_side(spec.side, plan, self.name, run_dir, log,
                               process_gpu(plan, "decode", instance * spec.tp + tp_rank))
        self.buffers = buffers = self.side.buffers
        layout = describe(buffers.specs)
        ptrs, _, item_lens = buffers.get_buf_infos()
        size = spec.side.buffers.size
        slots = SlotAllocator(size)
        self.peers = Peers(secret, spec.timeout_s)
        digest = RowDigest(buffers, self.peers.keys, spec.digest)
        buffers.warm()  # start-up pays the device's first-use costs, not request 1
        digest.warm()
        control.mark("warm-up")
        self.timeout_s = spec.timeout_s
        self.group = group or single()
        self.ledger = ledger = Ledger(size)
        self.notices = Notices()
        self.res = DecodeResult(self.name, tp_rank=self.tp_rank)
        judge = Judge(spec.gate, spec.timeout_s, buffers, digest, self.res)
        self.records = RunFile(RunFiles(run_dir).verdicts(self.name), "w", buffering=1 << 16)  # NoSpace names it
        # gate.read: how the readiness gate reads rooms on device rows (host rows: a plain read)
        rows = Rows(buffers, digest, slots, spec.gate.read,
                    decode_setup(buffers, spec.faults, spec.gate.zero_room_on_free))
        self.load = _forward_loop(spec, buffers, rows.host_rows, instance * spec.tp + tp_rank, log)
        self.net = Sockets(spec.host, spec.timeout_s, spec.faults, wire.max_frame_bytes(item_lens, size))
        drop = Drops(self.res, log)
        replies = Replies(self.net.control, self.peers, log)
        self.grants = Grants(ledger, slots, rows, self.peers, self.res, replies, drop, log,
                             self.group.size, self.leader)
        offer = Offer(self.session_id, ptrs, item_lens, size, layout, tp_rank, buffers.scratch_ptr)
        handshake = DecodeHandshake(offer, self.peers, replies, drop, digest, self.notices, plan, log, self.leader)
        self.control = Control(self.peers, handshake, self.grants, self.notices, drop, self.leader)
        self.data = DataPlane(ledger, self.peers, drop, ptrs, item_lens, size,
                              plan.route.value == "tcp" and rows.host_rows)
        self.stepper = Stepper(ledger, rows, judge, self.group, self.grants, self.res, self.records, log, size)

    def advert(self, bulk_bytes: int = 0) -> DecodeAdvert:
        """What this process tells the runner once it is up (its Ready): its endpoints, its
        transport and engine session. `bulk_bytes` > 0 also asks the backend for a bulk target
        region of that size on the buffers' device (the benchmark's bandwidth point)."""
        exposed = tuple(self.side.backend.exposed())
        bulk_ptr = self.side.backend.bulk_target(bulk_bytes) if bulk_bytes else None
        return DecodeAdvert(self.net.control_endpoint, self.net.data_endpoint, self.side.transport,
                            self.session_id, exposed, bulk_ptr)

    @property
    def leader(self) -> bool:
        return self.group.rank == 0

    @property
    def session_id(self) -> Optional[str]:
        """The engine session advertised at bootstrap (silent_peer: a port that never answers)."""
        if self.net.silent is not None:
            return "%s:%d" % self.net.silent.getsockname()
        return self.side.backend.session_id

    def serve(self, chan: control.Pipe) -> None:
        """Take messages and step until the runner says stop (a TP group: until any rank
        was told to, all together). Each pass blocks in one poll over everything this process
        serves (control, data and the runner's pipe) for no longer than its next timer (the
        leader's heartbeats, the prefills' liveness) or the readiness gate's re-check allows;
        the timers' work runs when it is due, not on every pass."""
        pipe = chan.fileno()
        # (zmq_poll takes a plain fd beside its sockets)
        items = cast("list[tuple[zmq.Socket, int]]", [(self.net.control, _POLLIN), (self.net.data, _POLLIN),
                                                      (pipe, _POLLIN)])
        lockstep = self.group.size > 1
        spin = self.spec.poll.spins(usable_cores())
        self.log.info("decode_loop", poll="spin" if spin else "block")
        load = self.load
        if load is not None:
            load.start()
        busy = spin or load is not None  # a pass never sleeps in the poll
        led, notices = self.ledger, self.notices
        due = 0.0  # when the timers' work is next due (clock seconds): at the first pass
        wait = 0
        while True:
            if load is not None:
                load.tick()  # the next forward is queued before the poll, as SGLang's overlap scheduler does
            piped = self.take(zmq_poll(items, wait))
            self.stepper.step()
            if led.verdicts or (led.granted and any(g.shared for gs in led.granted.values() for g in gs)):
                self.grants.flush()
            now = _clock()  # the pass's one clock read of its own
            if now >= due:
                due = self.on_timer(now)
            if notices.pending:
                notices.send(chan)
            stop = (piped and chan.poll() and self.on_pipe(chan.recv())) or Shutdown.requested
            if lockstep:
                stop = self.group.any(stop)
            if stop:
                self.on_stop(lockstep)
                return
            wait = poll_wait_ms(busy, bool(led.ready) or lockstep, due, now)

    def on_timer(self, now: float) -> float:
        """The periodic work, when due: the leader's heartbeats to the prefills that wait on
        it, and (role=decode) the prefills' liveness. Returns when it is next due."""
        due = now + self.peers.heartbeat_s
        if self.leader:
            due = min(due, self.grants.heartbeat(now))
        if self.spec.watch_prefills and self.leader:  # role=both: the runner watches them
            due = min(due, self.watch_prefills(now))
        return max(due, now + 1e-3)  # (a reply that failed is tried again, not in a spin)

    def on_stop(self, lockstep: bool) -> None:
        self.res.memory["rss_kb_end"] = rss_kb()
        if self.load is not None:
            self.res.load = self.load.summary(self.spec.load.step_ms)
        if lockstep:
            assert isinstance(self.group, TorchGroup)  # (size > 1)
            self.res.tp = self.group.summary()

    def take(self, events: list[tuple[Any, int]]) -> bool:
        """What the poll found: up to 1024 control messages, then up to 4096 data frames.
        True when the runner's pipe has something."""
        piped = False
        for sock, _ in events:
            if sock is self.net.control:
                _drain(sock, self.control.on_control, 1024)
            elif sock is self.net.data:
                _drain(sock, self.data.on_data, 4096)
            else:
                piped = True
        return piped

    def on_pipe(self, msg: object) -> bool:
        """A message from the runner; True for Stop."""
        match msg:
            case control.Stop():
                return True
            case control.PrefillGone(rank=rank):
                self.grants.release(rank, "prefill process gone")
                return False
            case _:
                raise control.ProtocolError(f"a decode does not take {type(msg).__name__}")

    def watch_prefills(self, now: float) -> float:
        """role=decode: a prefill rank whose loop runs (or that holds granted slots) and has
        sent nothing for transport.timeout_s is lost, and so is one bound at hello whose loop
        never started within endpoints.startup_timeout_s (the runner on this host cannot see
        its process; a live loop says something at least every min(1 s, timeout_s/4)).
        Returns when it is next due."""
        peers = self.peers
        if now - peers.watched_at < peers.heartbeat_s:  # nobody can have gone silent since
            return peers.watched_at + peers.heartbeat_s
        if now - peers.watched_at > self.timeout_s / 2:  # WE were stalled: nobody could be heard
            peers.heard = {rank: now for rank in peers.heard}
        peers.watched_at = now
        running = {g.prank for g in self.ledger.grants.values()} | peers.started
        for prank, last in list(peers.heard.items()):
            if prank in peers.done:
                continue
            limit, what = ((self.timeout_s, "transport.timeout_s") if prank in running else
                           (self.spec.startup_timeout_s, "endpoints.startup_timeout_s"))
            if now - last > limit:
                why = (f"prefill rank {prank} silent for {what}={limit:g}" if prank in running else
                       f"prefill rank {prank} bound at hello, its loop not started within {what}={limit:g}")
                self.log.error("prefill_lost", prefill=prank, detail=why)
                peers.done.add(prank)
                self.grants.release(prank, why)
                self.notices.lost.append((prank, why))
        return now + peers.heartbeat_s

    def close(self) -> None:
        self.group.close()
        self.records.close()
        self.net.close()
