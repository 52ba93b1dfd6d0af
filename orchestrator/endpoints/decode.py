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

Control identity is a session, not a message: the first authentic hello for a prefill rank
binds that rank to its connection (the ROUTER identity) and opens a Session keyed with both
processes' per-run nonces (orchestrator.auth). Another hello for a bound rank, from any
connection, is refused and counted (`hijack_refused`); every later message of that rank,
control or data, must open under its session's keys. Replays inside the session (a control
message seen before, a status for a request already judged or with a status) are counted
(`replayed`) and change nothing. The leader also tells every bound prefill that it is
alive when it has had nothing to say for a while (an empty update), so a prefill whose
requests wait behind a stalled sibling's never takes this decode for lost.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq

from .. import wire
from ..auth import Authenticator, Replayed, Session, new_nonce
from ..buffers import SlotAllocator
from ..config import FaultKind, GateRead, OrchestratorConfig, Role
from ..digest import Keys, RowDigest
from ..faults import decode_setup, silent_listener
from ..layout import describe, first_difference
from ..outcomes import Detail, KVPoll, Outcome
from ..plan import Device, Plan, same_process_space_rule
from ..results import DecodeResult
from ..rundir import RunFiles
from ..transport.engine import exposed, listening_sockets
from .common import (report_failure, Stop, bind_random, boot_id, pid_namespace, build_side, new_socket, proc_name, process_gpu,
                     rss_kb, start_process)
from .tp import Group, single

_clock = time.monotonic


@dataclass(slots=True)
class PrefillSession:
    """One prefill rank as this process knows it: its connection, keys and last contact."""

    rank: int
    identity: bytes
    auth: Session
    keys: Keys
    told: float = 0.0  # the last message this process sent it


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
        self.auth = Authenticator(secret)  # hello and its answer only: the rest is per session
        self.keys = Keys(secret)
        self.secret = secret
        self.nonce = new_nonce()
        self.sessions: dict[bytes, PrefillSession] = {}  # control identity -> session
        self.heartbeat_s = max(0.05, min(1.0, cfg.transport.timeout_s / 4))  # well inside the prefill's timeout
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
        self.prefills: dict[int, PrefillSession] = {}  # prefill rank -> its session (bound at hello)
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
        # Device rows, one rank: a freed slot's zeroing is queued with the next step's device
        # pass and the slot is granted again only after that pass's one wait (TP groups and
        # host rows zero and free at once).
        self.quarantine: list[int] = []
        self.res = DecodeResult(self.name)
        self.records = open(RunFiles(run_dir).verdicts(self.name), "w", buffering=1 << 16)
        self.host_rows = self.buffers.device.type == Device.cpu.value
        self.defer_clears = not self.host_rows and self.group.size == 1
        # gate.read: how the readiness gate reads rooms on device rows (host rows: a plain read)
        self.gate_read = cfg.gate.read
        self.stream = None  # the stream of the step's device pass (None: the current one)
        if not self.host_rows and self.gate_read is GateRead.side_stream:
            import torch

            self.stream = torch.cuda.Stream(self.buffers.device, priority=-1)
        self.load = None
        if cfg.endpoints.decode_load.step_ms > 0:
            import torch

            # the decode GPU decodes whatever the aux rows' device: host rows (the gate reads
            # host memory) against CUDA rows (it reads behind the queued forward)
            gpu = self.buffers.device if not self.host_rows else (
                torch.device("cuda", (e.decode_gpus or [0])[(instance * e.decode_tp + tp_rank) % len(e.decode_gpus or [0])])
                if torch.cuda.is_available() else None)
            if gpu is None:
                log.warning("decode_load_off", detail="endpoints.decode_load needs a CUDA device: "
                            "none here, running without a forward loop")
            else:
                from .load import ForwardLoop

                torch.cuda.set_device(gpu)  # host rows: this process's only CUDA work
                with torch.cuda.device(gpu):
                    self.load = ForwardLoop(gpu, cfg.endpoints.decode_load.step_ms)
                    self.load.measure_idle(cfg.endpoints.decode_load.idle_s)  # before serving: no handoffs
                log.info("decode_load", step_ms=cfg.endpoints.decode_load.step_ms, device=str(gpu),
                         matmuls_per_step=self.load.matmuls, gate_read=self.gate_read.value,
                         forward_steps_per_s_idle=self.load.idle_per_s)
        self.boot_id = boot_id()
        self.pid_ns = pid_namespace()
        self.warm = 1000
        self._silent = silent_listener(cfg.transport.host) if cfg.faults.kind is FaultKind.silent_peer else None
        self.ctx = zmq.Context()
        host = cfg.transport.host
        self.control = new_socket(self.ctx, zmq.ROUTER, self.timeout_s)
        self.data = new_socket(self.ctx, zmq.PULL, self.timeout_s,
                               wire.max_frame_bytes(self.item_lens, cfg.buffers.size))
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
        sess = self.sessions.get(identity)
        try:
            body = (sess.auth if sess is not None else self.auth).unseal(frames[1]) \
                if len(frames) == 2 else None
        except Replayed as exc:
            self._drop("replayed", "control_replayed", prefill=sess.rank, error=str(exc))
            return
        if body is None:
            self._drop("rejected_auth", "control_rejected", reason="bad or missing MAC")
            return
        try:
            msg = wire.decode(body)
        except wire.WireError as exc:
            self._drop("dropped_control", "control_dropped", error=str(exc))
            return
        kind = msg["type"]
        prank = sess.rank if sess is not None else None
        if prank is not None:
            self.heard[prank] = _clock()
        if kind == "hello":
            self._hello(identity, sess, msg)
        elif sess is None:  # authentic under the bare secret, but only hello may be
            self._drop("rejected_auth", "control_rejected", reason=f"{kind} outside a session")
        elif kind == "arrive" and self.leader:
            for rid, room in msg["reqs"]:
                if len(self.waiting) >= self.waiting_cap:  # shed, and say so
                    self._drop("dropped_control", "arrival_shed",
                               error=f"{len(self.waiting)} arrivals already wait for a slot")
                    now_ns = time.monotonic_ns()
                    self.verdicts[prank].append([rid, Outcome.failed.code, Detail.decode_overloaded.code,
                                                 now_ns, now_ns, 0])
                    continue
                self.waiting.append((prank, rid, room, msg["contiguous"]))
            self.grant_waiting()
        elif kind == "bye" and self.leader:
            self.release_prefill(prank, "bye")
            self.byes.append(prank)
        else:
            self._drop("dropped_control", "control_dropped", error=f"{kind} is not for this rank")

    def _hello(self, identity: bytes, sess: Optional[PrefillSession], msg: dict) -> None:
        """The first authentic hello of a rank binds it to this connection; any other hello
        for a bound rank (a copy replayed from anywhere, or a second one) is refused."""
        rank = msg["rank"]
        bound = self.prefills.get(rank)
        if bound is not None or sess is not None:
            self._drop("hijack_refused", "hello_refused", prefill=rank,
                       detail="rank already bound to another connection" if bound is not None
                       and bound.identity != identity else "hello again on a bound connection")
            return
        diff = first_difference(self.layout, msg["layout"])
        if diff is not None:
            self.log.error("layout_mismatch", prefill=rank, detail=diff)
            self._reply(identity, wire.encode("error", detail=f"layout mismatch: {diff}"))
            if self.leader:
                self.refused.append((rank, f"layout mismatch: {diff}"))
            return
        why = same_process_space_rule(self.plan.engine_transport, (self.pid_ns, self.boot_id),
                                      (msg.get("pid_ns", ""), msg.get("boot_id", "")))
        if why is not None:  # refused before any byte moves, on both sides
            self.log.error("process_space_mismatch", prefill=rank, detail=why)
            self._reply(identity, wire.encode("error", detail=why))
            if self.leader:
                self.refused.append((rank, why))
            return
        keys = Keys(self.secret, msg["nonce"])
        new = PrefillSession(rank, identity, self.auth.session(rank, msg["nonce"], self.nonce, "decode"),
                             keys, _clock())
        self.digest.rank_keys[rank] = keys
        # the answer goes under the secret (the prefill needs our nonce to derive the session)
        self._reply(identity, wire.encode(
            "bootstrap", session_id=self.session_id, aux_ptrs=self.ptrs, item_lens=self.item_lens,
            slots=self.cfg.buffers.size, layout=self.layout, fingerprint=msg["fingerprint"],
            tp_rank=self.tp_rank, boot_id=self.boot_id, scratch_ptr=self.buffers.scratch_ptr,
            nonce=self.nonce, hello_nonce=msg["nonce"], pid_ns=self.pid_ns))
        self.sessions[identity] = new
        self.prefills[rank] = new
        self.heard[rank] = _clock()
        self.log.info("prefill_bound", prefill=rank)

    def _pad(self, prank: int, rid: int) -> tuple[int, int]:
        sess = self.prefills.get(prank)
        return (sess.keys if sess is not None else self.keys).pad(prank, rid)

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
                g = Grant(prank, rid, room, slot, self._pad(prank, rid), _clock(),
                          identity=self.prefills[prank].identity, shared=self.group.size == 1)
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
        g = Grant(prank, rid, room, slot, self._pad(prank, rid), _clock())
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
        sess = self.sessions.get(identity)
        try:
            self.control.send_multipart([identity, (sess.auth if sess is not None else self.auth).seal(payload)])
        except zmq.ZMQError as exc:
            self.log.warning("reply_failed", error=str(exc))
            return
        if sess is not None:
            sess.told = _clock()

    def heartbeat(self) -> None:
        """The leader's word (an empty update) to every bound prefill that waits on this
        process (a grant or an arrival of its is here) and has heard nothing for a while:
        the prefill's liveness check of this process rests on this process alone, not on
        what other prefills make it wait for."""
        now = _clock()
        due = [s for s in self.prefills.values() if now - s.told >= self.heartbeat_s]
        if not due:
            return
        waiting = {g.prank for g in self.grants.values()} | {w[0] for w in self.waiting}
        for sess in due:
            if sess.rank in waiting:
                self._reply(sess.identity, wire.encode("update", grants=[], v=[]))
            else:
                sess.told = now  # nothing owed: look again in a while

    # ---- data plane ---------------------------------------------------------------------
    def _data_auth(self, frames: list[bytes]) -> tuple[Optional[Session], bytes]:
        """The session a data-plane message claims (from the rank it names, or, for
        AUX_DATA, the grants of the slots it lands in) and the associated data its MAC
        covers; (None, b"") when it names nothing this process knows."""
        try:
            if frames[0] == wire.AUX_DATA:
                slot, field = int(frames[3]), int(frames[2])
                rows = max(1, len(frames[5]) // self.item_lens[field])
                gs = [self.by_slot.get(slot + k) for k in range(min(rows, self.cfg.buffers.size))]
                if not gs or any(g is None for g in gs):
                    return None, b""
                sess = self.prefills.get(gs[0].prank)
                return (sess.auth if sess else None), b"".join(g.rid.to_bytes(8, "little") for g in gs)
            rank = int(frames[1] if frames[0] == wire.STEP else frames[2])
        except (IndexError, ValueError, ZeroDivisionError):
            return None, b""
        sess = self.prefills.get(rank)
        return (sess.auth if sess else None), b""

    def on_data(self, frames: list[bytes]) -> None:
        auth, ad = self._data_auth(frames) if frames else (None, b"")
        body = auth.open(frames, ad) if auth is not None else None
        if body is None and not self.auth.enabled:  # no secret (interop tests): nothing to check
            body = list(frames)
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
            if g is None:  # authentic, this run's, for no live grant: judged already (a replay)
                self._drop("replayed", "status_replayed", prefill=prank, rid=rid, slot=slot)
                return
            if g.slot != slot or g.room != room:
                self._drop("unexpected", "status_for_no_grant", prefill=prank, rid=rid, slot=slot)
                return
        if status not in (KVPoll.Success, KVPoll.Failed):
            return  # non-terminal: SGLang ignores those too
        if g.status is not None:  # a second terminal status for one grant
            self._drop("replayed", "status_replayed", prefill=prank, rid=g.rid, slot=g.slot)
            return
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
            if self.quarantine and (self.waiting or 4 * len(self.quarantine) >= self.cfg.buffers.size):
                self._clear_pass()  # slots are wanted: a pass of its own
                self._flush()
            return
        t0 = time.perf_counter()
        cands = list(self.ready.values())
        taken_at = self._sglang_gate(cands) if self.gate_read is GateRead.sglang and not self.host_rows else None
        t_pass = time.perf_counter()
        cleared, self.quarantine = self.quarantine, []
        rows = self.digest.read([g.slot for g in cands], [(g.prank, g.rid) for g in cands], clear=cleared,
                                stream=self.stream)
        self._release(cleared)  # zeroed in the read's pass, covered by its wait
        now, now_ns = _clock(), time.monotonic_ns()
        t_end = time.perf_counter()
        self.res.gate_read_us.add(((t_pass - t0) if taken_at is not None else (t_end - t_pass)) * 1e6)
        self.res.stall_us.add((t_end - t0) * 1e6)
        for g, r in zip(cands, rows):
            if g.status == KVPoll.Failed:
                self._finish(g, Outcome.failed, Detail.sender_error, now_ns)
            elif self.unready(g, r, now):  # the gate: not landed yet
                if r.room == 0 and now - g.t_status > self.timeout_s:
                    self._finish(g, Outcome.failed, Detail.room_never_landed, now_ns)
                else:
                    self.res.gate_waits += 1
            else:  # taken (the gate passed at now_ns); the verdict once the digest is compared
                outcome, detail = self._judge(g, r)
                taken = taken_at.get(g.slot, now_ns) if taken_at is not None else now_ns
                self._finish(g, outcome, detail, time.monotonic_ns(), t_taken_ns=taken)
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
            if (self.buffers.checksum_field is not None and g.tag
                    and r.landed_tag not in (0, g.tag)):  # not the tag its sender wrote, nor none
                return Outcome.corrupted, Detail.written_by_someone_else
            return Outcome.corrupted, Detail.checksum_mismatch
        return Outcome.verified, Detail.none

    def _sglang_gate(self, cands: list[Grant]) -> dict[int, int]:
        """gate.read=sglang on device rows: SGLang 0.5.23's `_apply_metadata_gate`, one
        `bootstrap_room[idx, 0].item()` per ready request on the current stream (each a device
        sync, behind whatever is queued there). Returns when each was taken (ns); the verdict
        still comes from the step's digest pass."""
        out = {}
        for g in cands:
            self.buffers.room(g.slot)
            out[g.slot] = time.monotonic_ns()
        return out

    def _clear_pass(self) -> None:
        """Zero the quarantined slots' rooms and free them once that landed (one wait)."""
        import torch

        with torch.cuda.stream(self.stream or torch.cuda.current_stream(self.buffers.device)):
            cleared = self._queue_clears()
            self.buffers.sync()
        self._release(cleared)

    def _queue_clears(self) -> list[int]:
        """Queue the zeroing of the quarantined slots (device rows: no wait here)."""
        cleared, self.quarantine = self.quarantine, []
        if cleared:
            self.buffers.clear_slots(cleared)
        return cleared

    def _release(self, cleared: list[int]) -> None:
        for slot in cleared:
            self.slots.free(slot)

    def _finish(self, g: Grant, outcome: Outcome, detail: Detail, t_ns: int, own=None,
                t_taken_ns: int = 0) -> None:
        """The request's verdict (in a TP group: every rank's combined; `own` is this rank's
        judgement, which its counts and records keep). `t_taken_ns`: when the readiness gate
        let it through (0: never taken)."""
        mine, why = own if own is not None else (outcome, detail)
        self.res.outcomes[mine] += 1
        if mine is not Outcome.verified:
            self.res.details[why] += 1
            self.log.warning("handoff_rejected", prefill=g.prank, rid=g.rid, slot=g.slot, room=g.room,
                             outcome=mine.value, detail=why.value)
        if self.leader:
            self.verdicts[g.prank].append([g.rid, outcome.code, detail.code, t_ns,
                                           int(g.t_status * 1e9), t_taken_ns])
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
        if self.zero_on_free and self.defer_clears:
            self.quarantine.append(g.slot)
            return
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
                self._reply(self.prefills[prank].identity,
                            wire.encode("update", grants=[[g.rid, g.slot] for g in told], v=v))
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
        spin = self.cfg.endpoints.poll.spins()
        self.log.info("decode_loop", poll="spin" if spin else "block")
        load = self.load
        if load is not None:
            load.start()
        while True:
            if load is not None:
                load.tick()  # the next forward is queued before the poll, as SGLang's overlap scheduler does
            events = dict(poller.poll(0 if spin or load else 1 if (self.ready or lockstep) else 50))
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
            if self.leader:
                self.heartbeat()
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
                if load is not None:
                    self.res.load = load.summary(self.cfg.endpoints.decode_load.step_ms)
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
