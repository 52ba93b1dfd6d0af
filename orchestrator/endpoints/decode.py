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
(orchestrator.endpoints.tp).

Requests are identified by (prefill rank, request id), never by room alone.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq

from .. import wire
from ..auth import Authenticator
from ..buffers import SlotAllocator
from ..config import FaultKind, OrchestratorConfig, Role
from ..digest import Keys, RowDigest
from ..faults import decode_setup, silent_listener
from ..layout import describe, first_difference
from ..outcomes import Detail, KVPoll, Outcome
from ..plan import Device, Plan, same_process_space_rule
from ..results import DecodeResult
from ..transport.engine import exposed, listening_sockets
from .common import (report_failure, Stop, bind_random, boot_id, pid_namespace, build_side, new_socket, proc_name, process_gpu,
                     rss_kb, start_process)
from .tp import Group, single

_clock = time.monotonic


@dataclass(slots=True)
class Grant:
    prank: int
    rid: int
    room: int
    slot: int
    pad: tuple[int, int]
    t_granted: float
    status: Optional[int] = None  # KVPoll value of the status received
    reason: str = ""
    tag: int = 0  # from the status, when the row has no kv_checksum field
    t_status: float = 0.0
    identity: bytes = b""  # the prefill's control identity (leader only)
    shared: bool = True  # a TP leader's grant goes out only once every rank knows it
    settling: bool = False  # the gate held it: right room, digest not yet (gate.settle_ms)


class DecodeEndpoint:
    def __init__(self, cfg: OrchestratorConfig, plan: Plan, run_dir: Path, log, secret: bytes,
                 instance: int = 0, tp_rank: int = 0, group: Optional[Group] = None):
        self.cfg, self.plan, self.log = cfg, plan, log
        e = cfg.endpoints
        self.name = proc_name("decode", instance, e.decode_ranks, tp_rank, e.decode_tp)
        self.instance, self.tp_rank = instance, tp_rank
        self.side = build_side(cfg, plan, self.name, run_dir, log,
                               process_gpu(plan, "decode", instance * e.decode_tp + tp_rank))
        self.buffers = self.side.buffers
        self.layout = describe(self.buffers.specs)
        self.ptrs, _, self.item_lens = self.buffers.get_buf_infos()
        self.slots = SlotAllocator(cfg.buffers.size)
        self.auth = Authenticator(secret)
        self.keys = Keys(secret)
        self.digest = RowDigest(self.buffers, self.keys, cfg.verify.digest)
        self.buffers.warm()  # start-up pays the device's first-use costs, not request 1
        self.digest.warm()
        self.timeout_s = cfg.transport.timeout_s
        self.readiness = cfg.gate.readiness
        self.settle_s = cfg.gate.settle_ms / 1e3
        self.zero_on_free = decode_setup(self.buffers, cfg.faults, cfg.gate.zero_room_on_free)
        self.group = group or single()
        self.leader = self.group.rank == 0
        self.grants: dict[tuple[int, int], Grant] = {}  # in grant order (a TP group's shared order)
        self.by_slot: dict[int, Grant] = {}
        self.ready: dict[tuple[int, int], Grant] = {}  # grants whose status arrived, not yet judged
        self.waiting: collections.deque = collections.deque()  # arrivals without a free slot
        self.waiting_cap = max(4 * cfg.buffers.size, 1024)
        self.next_slot: dict[int, int] = {}  # prefill rank -> the slot after its last grant
        self.prefills: dict[int, bytes] = {}  # prefill rank -> control identity
        self.new_grants: list[Grant] = []  # granted since the last step (the leader shares them)
        self.verdicts: dict[int, list[list[int]]] = collections.defaultdict(list)
        self.granted: dict[int, list[Grant]] = collections.defaultdict(list)  # not yet told
        self.pending_releases: list[int] = []  # prefills released since the last TP step
        self.byes: list[int] = []  # prefill ranks that said bye (the runner is told)
        self.refused: list[tuple[int, str]] = []  # prefill ranks refused at hello, and why
        self.lost: list[tuple[int, str]] = []  # prefill ranks gone silent (role=decode only)
        self.heard: dict[int, float] = {}  # prefill rank -> last authentic message from it
        self.watch_prefills = cfg.role is Role.decode  # role=both: the runner watches them
        self.to_clear: list[int] = []
        self.res = DecodeResult(self.name)
        self.records = open(run_dir / f"verdicts-{self.name}.jsonl", "w", buffering=1 << 16)
        self.host_rows = self.buffers.device.type == Device.cpu.value
        self.boot_id = boot_id()
        self.pid_ns = pid_namespace()
        self.warm = 1000
        self._silent = silent_listener(cfg.transport.host) if cfg.faults.kind is FaultKind.silent_peer else None
        self.ctx = zmq.Context()
        host = cfg.transport.host
        self.control = new_socket(self.ctx, zmq.ROUTER, self.timeout_s)
        self.data = new_socket(self.ctx, zmq.PULL, self.timeout_s)
        self.control_endpoint = bind_random(self.control, host)
        self.data_endpoint = bind_random(self.data, host)

    @property
    def session_id(self) -> Optional[str]:
        """The engine session advertised at bootstrap (silent_peer: a port that never answers)."""
        if self._silent is not None:
            return "%s:%d" % self._silent.getsockname()
        return self.side.engine.session_id if self.side.engine else None

    # ---- control plane (hello on every rank; the rest on the leader) ----------------------
    def on_control(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._drop("dropped_control", "control_dropped", error="no payload frame")
            return
        identity = frames[0]
        body = self.auth.unseal(frames[1]) if len(frames) == 2 else None
        if body is None:
            self._drop("rejected_auth", "control_rejected", reason="bad or missing MAC")
            return
        try:
            msg = wire.decode(body)
        except wire.WireError as exc:
            self._drop("dropped_control", "control_dropped", error=str(exc))
            return
        kind = msg["type"]
        prank = self._prank(identity)
        if prank is not None:
            self.heard[prank] = _clock()
        if kind == "hello":
            diff = first_difference(self.layout, msg["layout"])
            if diff is not None:
                self.log.error("layout_mismatch", prefill=msg["rank"], detail=diff)
                self._reply(identity, wire.encode("error", detail=f"layout mismatch: {diff}"))
                if self.leader:
                    self.refused.append((msg["rank"], f"layout mismatch: {diff}"))
                return
            why = same_process_space_rule(self.plan.engine_transport, (self.pid_ns, self.boot_id),
                                          (msg.get("pid_ns", ""), msg.get("boot_id", "")))
            if why is not None:  # refused before any byte moves, on both sides
                self.log.error("process_space_mismatch", prefill=msg["rank"], detail=why)
                self._reply(identity, wire.encode("error", detail=why))
                if self.leader:
                    self.refused.append((msg["rank"], why))
                return
            self.prefills[msg["rank"]] = identity
            self._reply(identity, wire.encode(
                "bootstrap", session_id=self.session_id, aux_ptrs=self.ptrs, item_lens=self.item_lens,
                slots=self.cfg.buffers.size, layout=self.layout, fingerprint=msg["fingerprint"],
                tp_rank=self.tp_rank, boot_id=self.boot_id, scratch_ptr=self.buffers.scratch_ptr,
                pid_ns=self.pid_ns))
        elif kind == "arrive" and self.leader:
            prank = self._prank(identity)
            if prank is None:
                self._drop("unexpected", "arrive_before_hello")
                return
            for rid, room in msg["reqs"]:
                if len(self.waiting) >= self.waiting_cap:  # shed, and say so
                    self._drop("dropped_control", "arrival_shed",
                               error=f"{len(self.waiting)} arrivals already wait for a slot")
                    now_ns = time.monotonic_ns()
                    self.verdicts[prank].append([rid, Outcome.failed.code, Detail.decode_overloaded.code,
                                                 now_ns, now_ns])
                    continue
                self.waiting.append((prank, rid, room, msg["contiguous"]))
            self.grant_waiting()
        elif kind == "bye" and self.leader:
            prank = self._prank(identity)
            if prank is not None:
                self.release_prefill(prank, "bye")
                self.byes.append(prank)
        else:
            self._drop("dropped_control", "control_dropped", error=f"{kind} is not for this rank")

    def _prank(self, identity: bytes) -> Optional[int]:
        for rank, ident in self.prefills.items():
            if ident == identity:
                return rank
        return None

    def grant_waiting(self) -> None:
        """Grant slots to waiting arrivals, in order. Arrivals marked contiguous get
        consecutive slots (continuing after the prefill's previous grant when it can), so a
        coalesced send covers them with one block per field."""
        while self.waiting and self.slots.available:
            prank, rid, room, contiguous = self.waiting[0]
            n = 1
            if contiguous:
                while (n < len(self.waiting) and n < self.slots.available
                       and self.waiting[n][0] == prank and self.waiting[n][3]):
                    n += 1
                slots = self.slots.alloc_run(n, self.next_slot.get(prank))
                self.next_slot[prank] = slots[-1] + 1
            else:
                slots = [self.slots.alloc()]
            for slot in slots:
                prank, rid, room, _ = self.waiting.popleft()
                if (prank, rid) in self.grants:
                    self.slots.free(slot)
                    self._drop("unexpected", "duplicate_arrival", prefill=prank, rid=rid)
                    continue
                g = Grant(prank, rid, room, slot, self.keys.pad(prank, rid), _clock(),
                          identity=self.prefills[prank], shared=self.group.size == 1)
                self._add(g)
                self.new_grants.append(g)
                self.granted[prank].append(g)

    def _add(self, g: Grant) -> None:
        self.grants[(g.prank, g.rid)] = g
        self.by_slot[g.slot] = g
        self.res.grants += 1

    def adopt_grant(self, prank: int, rid: int, slot: int, room: int) -> Grant:
        """A TP follower learns a grant its leader made (the same slot in its own buffers)."""
        self.slots._take(slot)
        g = Grant(prank, rid, room, slot, self.keys.pad(prank, rid), _clock())
        self._add(g)
        return g

    def release_prefill(self, prank: int, why: str) -> None:
        """A prefill that said bye (or died) writes nothing more: its slots go back (in a TP
        group, on every rank at the next step)."""
        if self.group.size > 1:
            if self.leader:
                self.pending_releases.append(prank)
            return
        gone = [g for g in self.grants.values() if g.prank == prank]
        for g in gone:
            self._remove(g)
        self._flush()
        self.waiting = collections.deque(w for w in self.waiting if w[0] != prank)
        if gone:
            self.log.info("grants_released", prefill=prank, count=len(gone), why=why)
        self.grant_waiting()

    def _reply(self, identity: bytes, payload: bytes) -> None:
        try:
            self.control.send_multipart([identity, self.auth.seal(payload)])
        except zmq.ZMQError as exc:
            self.log.warning("reply_failed", error=str(exc))

    # ---- data plane ---------------------------------------------------------------------
    def on_data(self, frames: list[bytes]) -> None:
        body = self.auth.open(frames)
        if body is None:
            self._drop("rejected_auth", "data_rejected", reason="bad or missing MAC")
            return
        try:
            msg = wire.parse(body, self.item_lens, self.cfg.buffers.size)
        except wire.WireError as exc:
            self._drop("dropped_data", "frame_dropped", error=str(exc))
            return
        if isinstance(msg, wire.AuxData):
            self._land(msg)
        elif isinstance(msg, wire.StepStatus):
            for e in msg.entries.tolist():
                self._status(msg.prefill_rank, e[1], e[3], e[0], e[2], e[4], "")
        else:
            self._status(msg.prefill_rank, msg.room, msg.status, msg.rid, msg.slot, msg.tag, msg.reason)

    def _land(self, msg: wire.AuxData) -> None:
        if self.plan.route.value != "tcp" or not self.host_rows:
            self._drop("unexpected", "aux_data_on_engine_route", slot=msg.slot)
            return
        first = self.by_slot.get(msg.slot)
        if first is None or first.room != msg.room or any(
                (msg.slot + k) not in self.by_slot for k in range(msg.rows)):
            self._drop("unexpected", "frame_for_ungranted_slot", slot=msg.slot, room=msg.room)
            return
        wire.write_rows(self.ptrs, self.item_lens, msg)

    def _status(self, prank: int, room: int, status: int, rid: Optional[int], slot: Optional[int],
                tag: int, reason: str) -> None:
        self.heard[prank] = _clock()
        if rid is None:  # a bare SGLang status: only its room identifies the request
            found = [g for g in self.grants.values() if g.prank == prank and g.room == room]
            if len(found) != 1:
                self._drop("ambiguous" if found else "unexpected", "status_without_identity",
                           prefill=prank, room=room, matches=len(found))
                return
            g = found[0]
        else:
            g = self.grants.get((prank, rid))
            if g is None or g.slot != slot or g.room != room:
                self._drop("unexpected", "status_for_no_grant", prefill=prank, rid=rid, slot=slot)
                return
        if status not in (KVPoll.Success, KVPoll.Failed) or g.status is not None:
            return  # non-terminal, or a second status: SGLang ignores those too
        g.status, g.tag, g.reason, g.t_status = status, tag, reason, _clock()
        self.ready[(g.prank, g.rid)] = g

    def _drop(self, counter: str, event: str, **kw) -> None:
        """Count a message not acted on; log the first few of each kind, then every 1000th."""
        n = getattr(self.res, counter) + 1
        setattr(self.res, counter, n)
        if n <= 5 or n % 1000 == 0:
            self.log.warning(event, count=n, **kw)

    # ---- judging ------------------------------------------------------------------------
    def step(self) -> None:
        """One decode step: judge what has a status (a TP group first agrees on it)."""
        self.group.share_grants(self)
        if self.group.size > 1:
            self.group.step(self)
            return
        if not self.ready:
            return
        t0 = time.perf_counter()
        cands = list(self.ready.values())
        rows = self.digest.read([g.slot for g in cands], [(g.prank, g.rid) for g in cands])
        now, now_ns = _clock(), time.monotonic_ns()
        for g, r in zip(cands, rows):
            if g.status == KVPoll.Failed:
                self._finish(g, Outcome.failed, Detail.sender_error, now_ns)
            elif self.unready(g, r, now):  # the gate: not landed yet
                if r.room == 0 and now - g.t_status > self.timeout_s:
                    self._finish(g, Outcome.failed, Detail.room_never_landed, now_ns)
                else:
                    self.res.gate_waits += 1
            else:
                self._finish(g, *self._judge(g, r), now_ns)
        self.res.verify_us.add((time.perf_counter() - t0) * 1e6)
        self.res.batch.add(len(cands))
        self.res.steps += 1
        self._flush()

    def unready(self, g: Grant, r, now: float) -> bool:
        """The readiness gate (gate.readiness): "done" still counts as "transferring" while
        the row's room is 0 (SGLang's fix), and, within gate.settle_ms of the status, while
        the room is right but the digest is not yet (a torn row: the room block landed
        before the others). Past the window the row is judged: corrupted."""
        if not self.readiness:
            return False
        if r.room == 0:
            return True
        if self.settle_s and r.room == g.room and now - g.t_status < self.settle_s \
                and not self._digest_ok(g, r):
            if not g.settling:
                g.settling = True
                self.res.settled += 1
            return True
        return False

    def _digest_ok(self, g: Grant, r) -> bool:
        landed = r.landed_tag if self.buffers.checksum_field is not None else g.tag
        return self.digest.expected_tag(r, g.pad) == landed

    def _judge(self, g: Grant, r) -> tuple[Outcome, Detail]:
        if r is None:  # agreed by the group, never seen here (TP divergence)
            return Outcome.failed, Detail.tp_disagreement
        if r.room == 0:  # taken before its row landed: what a decode without the gate does
            return Outcome.corrupted, Detail.taken_unready
        if r.room != g.room:
            return Outcome.corrupted, Detail.room_mismatch
        if not self._digest_ok(g, r):
            return Outcome.corrupted, Detail.checksum_mismatch
        return Outcome.verified, Detail.none

    def _finish(self, g: Grant, outcome: Outcome, detail: Detail, t_ns: int, own=None) -> None:
        """The request's verdict (in a TP group: every rank's combined; `own` is this rank's
        judgement, which its counts and records keep)."""
        mine, why = own if own is not None else (outcome, detail)
        self.res.outcomes[mine] += 1
        if mine is not Outcome.verified:
            self.res.details[why] += 1
            self.log.warning("handoff_rejected", prefill=g.prank, rid=g.rid, slot=g.slot, room=g.room,
                             outcome=mine.value, detail=why.value)
        if self.leader:
            self.verdicts[g.prank].append([g.rid, outcome.code, detail.code, t_ns,
                                           int(g.t_status * 1e9)])
        self.records.write(f'{{"prefill": {g.prank}, "rid": {g.rid}, "outcome": "{mine.value}", '
                           f'"detail": "{why.value}"}}\n')
        self._remove(g)
        if self.res.judged == self.warm:
            self.res.memory["rss_kb_warm"] = rss_kb()

    def _remove(self, g: Grant) -> None:
        key = (g.prank, g.rid)
        del self.grants[key]
        del self.by_slot[g.slot]
        self.ready.pop(key, None)
        if self.zero_on_free:
            self.to_clear.append(g.slot)
        self.slots.free(g.slot)

    def _flush(self) -> None:
        """End of a step: zero the freed rooms, send the verdicts, grant what waits."""
        if self.to_clear:
            self.buffers.clear_slots(self.to_clear)
            self.to_clear = []
            if not self.host_rows:
                # Device rows: the zeroing is a kernel on this process's stream, and a freed
                # slot is granted below; the next owner's row, written by the prefill's
                # engine outside this stream, must not land before the zero does (once a
                # step, not per request).
                self.buffers.sync()
        if self.leader and self.waiting:
            self.grant_waiting()
        for prank in set(self.verdicts) | set(self.granted):
            told = [g for g in self.granted.get(prank, []) if g.shared]
            v = self.verdicts.pop(prank, [])
            if told or v:
                self._reply(self.prefills[prank], wire.encode("update", grants=[[g.rid, g.slot] for g in told], v=v))
            left = [g for g in self.granted.get(prank, []) if not g.shared]
            if left:
                self.granted[prank] = left
            else:
                self.granted.pop(prank, None)

    # ---- loop ---------------------------------------------------------------------------
    def serve(self, conn) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        poller.register(conn.fileno(), zmq.POLLIN)
        lockstep = self.group.size > 1
        while True:
            events = dict(poller.poll(1 if (self.ready or lockstep) else 50))
            if self.control in events:
                for _ in range(1024):
                    try:
                        self.on_control(self.control.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if self.data in events:
                for _ in range(4096):
                    try:
                        self.on_data(self.data.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            self.step()
            if self.verdicts or any(g.shared for gs in self.granted.values() for g in gs):
                self._flush()
            while self.byes:
                conn.send(("bye", self.byes.pop()))
            if self.watch_prefills and self.leader:
                self._watch_prefills()
            while self.refused:
                conn.send(("refused", self.refused.pop()))
            while self.lost:
                conn.send(("prefill_lost", self.lost.pop()))
            stop = False
            if conn.fileno() in events and conn.poll():
                msg = conn.recv()
                if msg == "stop":
                    stop = True
                elif isinstance(msg, tuple) and msg[0] == "prefill_gone":
                    self.release_prefill(msg[1], "prefill process gone")
            stop = stop or Stop.requested
            if lockstep:
                stop = self.group.any(stop)
            if stop:
                self.res.memory["rss_kb_end"] = rss_kb()
                if self.group.size > 1:
                    self.res.tp = self.group.summary()
                return

    def _watch_prefills(self) -> None:
        """role=decode: a prefill rank that holds granted slots and has sent nothing for
        transport.timeout_s is lost (the runner on this host cannot see its process)."""
        now = _clock()
        owing = {g.prank for g in self.grants.values()}
        for prank in owing:
            last = self.heard.get(prank)
            if last is not None and now - last > self.timeout_s:
                why = f"prefill rank {prank} silent for transport.timeout_s={self.timeout_s:g} holding slots"
                self.log.error("prefill_lost", prefill=prank, detail=why)
                self.heard.pop(prank)
                self.release_prefill(prank, why)
                self.lost.append((prank, why))

    def close(self) -> None:
        self.group.close()
        self.records.close()
        if self._silent is not None:
            self._silent.close()
        self.control.close(0)
        self.data.close(0)
        self.ctx.term()


def decode_main(cfg: OrchestratorConfig, plan: Plan, run_dir: str, secret: bytes, conn,
                instance: int = 0, tp_rank: int = 0, bulk_bytes: int = 0) -> None:
    """Process entry (multiprocessing spawn) of one decode process. `bulk_bytes` > 0 also
    registers a bulk target region of that size on the buffers' device (the benchmark's
    bandwidth point)."""
    run_path = Path(run_dir)
    e = cfg.endpoints
    name = proc_name("decode", instance, e.decode_ranks, tp_rank, e.decode_tp)
    log = start_process(name, run_path, cfg.logging.console)
    endpoint = None
    try:
        group = None
        if e.decode_tp > 1:
            from .tp import join

            kind, rendezvous = conn.recv()
            group = join(plan, rendezvous, tp_rank, e.decode_tp, cfg.transport.timeout_s,
                         process_gpu(plan, "decode", instance * e.decode_tp + tp_rank),
                         run_path / f"tp-{name}.jsonl")
        endpoint = DecodeEndpoint(cfg, plan, run_path, log, secret, instance, tp_rank, group)
        info = {
            "control_endpoint": endpoint.control_endpoint,
            "data_endpoint": endpoint.data_endpoint,
            "transport": endpoint.side.transport,
            "session_id": endpoint.session_id,
            "engine_exposed": exposed(listening_sockets()) if endpoint.side.engine else [],
        }
        if bulk_bytes and endpoint.side.engine is not None:
            import torch

            bulk = torch.empty(bulk_bytes, dtype=torch.uint8, device=endpoint.buffers.device)
            endpoint.side.engine.register(bulk.data_ptr(), bulk_bytes)
            info["bulk_ptr"] = bulk.data_ptr()
        conn.send(("ready", info))
        endpoint.serve(conn)
        conn.send(("stats", endpoint.res))
    except Exception as exc:  # reported to the runner, which owns the user-facing message
        line = report_failure(log, "decode_failed", exc)
        try:
            conn.send(("error", line))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if endpoint is not None:
            endpoint.close()
