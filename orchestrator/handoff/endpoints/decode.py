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
(orchestrator.endpoints.tp). One step, on one rank or many: poll -> agree on the polls ->
judge -> agree on the verdicts -> finish; a single rank's agreement is its own input.

Requests are identified by (prefill rank, request id), never by room alone.

Control identity is a session, not a message: the first authentic hello for a prefill rank
binds that rank to its connection (the ROUTER identity) and opens a Session keyed with both
processes' per-run nonces (orchestrator.transport.auth). Another hello for a bound rank, from any
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
from typing import Any, Optional

import zmq

from orchestrator.handoff import protocol
from orchestrator.handoff.buffers import SlotAllocator
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.endpoints.common import (
    Stop,
    bind_random,
    build_side,
    heartbeat_s,
    new_socket,
    process_gpu,
    report_failure,
    rss_kb,
    start_process,
)
from orchestrator.handoff.endpoints.tp import NOT_TAKEN, Group, TorchGroup, single
from orchestrator.handoff.faults import decode_setup, silent_session
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, Replayed, Session, new_nonce
from orchestrator.handoff.transport.engine import exposed, listening_sockets
from orchestrator.profile.config import GateRead, OrchestratorConfig, Role
from orchestrator.profile.layout import describe, first_difference
from orchestrator.profile.plan import Device, Plan, same_process_space_rule
from orchestrator.profile.platform import boot_id, pid_namespace
from orchestrator.results.outcomes import Detail, KVPoll, Outcome
from orchestrator.results.records import DecodeResult
from orchestrator.results.rundir import RunFiles, proc_name

_clock = time.monotonic
_WARM = 1000  # judged requests after which the process's memory is taken as warm (rss_kb_warm)


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
    shared: bool = True  # a TP leader's grant goes out only once every rank knows it
    settling: bool = False  # the gate held it: right room, digest not yet (gate.settle_ms)


@dataclass(slots=True)
class Verdict:
    """This rank's verdict on a request in one step: `t_ns` when it was made, `t_taken_ns`
    when the readiness gate let it through (0: never taken)."""

    outcome: Outcome
    detail: Detail
    t_ns: int
    t_taken_ns: int

    @property
    def code(self) -> int:
        """What a TP group's ranks agree on (the MIN: failed before corrupted before verified)."""
        return self.outcome.code * 256 + self.detail.code


class Peers:
    """The prefill ranks this process knows, and what it tells them of itself: the
    hello-level authenticator (the bare secret), each rank's session (bound at its first
    authentic hello), when each was last heard from, and this process's nonce and process
    space (boot id, pid namespace)."""

    def __init__(self, secret: bytes, timeout_s: float):
        self.secret = secret
        self.auth = Authenticator(secret)  # hello and its answer only: the rest is per session
        self.keys = Keys(secret)
        self.nonce = new_nonce()
        self.boot_id, self.pid_ns = boot_id(), pid_namespace()
        self.sessions: dict[bytes, PrefillSession] = {}  # control identity -> session
        self.ranks: dict[int, PrefillSession] = {}  # prefill rank -> its session (bound at hello)
        self.heard: dict[int, float] = {}  # prefill rank -> last authentic message from it
        self.started: set[int] = set()  # ranks whose loop runs (an arrive came, maybe empty)
        self.done: set[int] = set()  # ranks that said bye or were declared lost
        self.watched_at = _clock()  # the last liveness check (role=decode)
        self.heartbeat_s = heartbeat_s(timeout_s)

    def pad(self, prank: int, rid: int) -> tuple[int, int]:
        sess = self.ranks.get(prank)
        return (sess.keys if sess is not None else self.keys).pad(prank, rid)

    def bind(self, sess: PrefillSession) -> None:
        self.sessions[sess.identity] = sess
        self.ranks[sess.rank] = sess
        self.heard[sess.rank] = _clock()


class Ledger:
    """The requests this rank holds: its grants, in grant order (a TP group's shared order),
    by request and by slot; those whose status arrived, not yet judged; arrivals waiting for
    a free slot; and what the leader owes: grants to share with its ranks and to tell the
    prefills, verdicts to send, prefill ranks to release on every rank."""

    def __init__(self, size: int):
        self.grants: dict[tuple[int, int], Grant] = {}
        self.by_slot: dict[int, Grant] = {}
        self.ready: dict[tuple[int, int], Grant] = {}  # grants whose status arrived, not yet judged
        self.waiting: collections.deque = collections.deque()  # arrivals without a free slot
        self.waiting_cap = max(4 * size, 1024)
        self.next_slot: dict[int, int] = {}  # prefill rank -> the slot after its last grant
        self.new_grants: list[Grant] = []  # granted since the last step (the leader shares them)
        self.verdicts: dict[int, list[list[int]]] = collections.defaultdict(list)
        self.granted: dict[int, list[Grant]] = collections.defaultdict(list)  # not yet told
        self.pending_releases: list[int] = []  # prefills released since the last TP step

    def add(self, g: Grant) -> None:
        self.grants[(g.prank, g.rid)] = g
        self.by_slot[g.slot] = g

    def drop(self, g: Grant) -> None:
        key = (g.prank, g.rid)
        del self.grants[key]
        del self.by_slot[g.slot]
        self.ready.pop(key, None)

    def of(self, prank: int) -> list[Grant]:
        return [g for g in self.grants.values() if g.prank == prank]


class Notices:
    """What the leader tells the runner: prefill ranks that said bye, were refused at hello
    (and why), or went silent (role=decode only)."""

    def __init__(self) -> None:
        self.byes: list[int] = []
        self.refused: list[tuple[int, str]] = []
        self.lost: list[tuple[int, str]] = []

    def send(self, chan: protocol.Channel) -> None:
        while self.byes:
            chan.send(protocol.Bye(self.byes.pop()))
        while self.refused:
            chan.send(protocol.Refused(*self.refused.pop()))
        while self.lost:
            chan.send(protocol.PrefillLost(*self.lost.pop()))


class Sockets:
    """The control (ROUTER) and data (PULL) sockets, on random ports of transport.host, and
    the silent_peer fault's listener (the engine session advertised instead of the real one)."""

    def __init__(self, cfg: OrchestratorConfig, max_frame_bytes: int):
        host, timeout_s = cfg.transport.host, cfg.transport.timeout_s
        self.silent = silent_session(cfg.faults, host)
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


class Rows:
    """This rank's rows as the step reads them, and the zeroing of freed slots' rooms
    (gate.zero_room_on_free).

    One rank reads as gate.read says (host rows: a plain read); a TP group's ranks read
    plainly (gate.read does not apply). Device rows of one rank queue a freed slot's zeroing
    with the next step's read pass and free the slot only after that pass's one wait; TP
    groups and host rows zero at the step's end and free at once."""

    def __init__(self, buffers, digest: RowDigest, slots: SlotAllocator, mode: GateRead,
                 zero_on_free: bool, one_rank: bool):
        self.buffers, self.digest, self.slots, self.mode = buffers, digest, slots, mode
        self.zero_on_free = zero_on_free
        self.host_rows = buffers.device.type == Device.cpu.value
        self.defer_clears = not self.host_rows and one_rank
        self.quarantine: list[int] = []  # freed, zeroed with the next read pass (defer_clears)
        self.to_clear: list[int] = []  # freed, zeroed at the step's end
        self.stream = None  # the stream of the step's device pass (None: the current one)
        if not self.host_rows and mode is GateRead.side_stream:
            import torch

            self.stream = torch.cuda.Stream(buffers.device, priority=-1)

    def read_plain(self, cands: list[Grant]) -> list:
        """A TP rank's read: the rows of the requests with a status (None for the others)."""
        have = [g for g in cands if g.status is not None]
        rows = self.digest.read([g.slot for g in have], [(g.prank, g.rid) for g in have]) if have else []
        got = {id(g): r for g, r in zip(have, rows)}
        return [got.get(id(g)) for g in cands]

    def read_pass(self, cands: list[Grant], t0: float) -> tuple[list, Optional[dict[int, int]], float, float]:
        """One rank's read (every candidate has a status), zeroing the quarantined slots in
        the same pass: the rows, when the sglang gate took each (else None), the gate's read
        and the loop's stall since `t0` (perf_counter seconds)."""
        taken_at = self._sglang_gate(cands) if self.mode is GateRead.sglang and not self.host_rows else None
        t_pass = time.perf_counter()
        cleared, self.quarantine = self.quarantine, []
        rows = self.digest.read([g.slot for g in cands], [(g.prank, g.rid) for g in cands], clear=cleared,
                                stream=self.stream)
        self._release(cleared)  # zeroed in the read's pass, covered by its wait
        t_end = time.perf_counter()
        return rows, taken_at, ((t_pass - t0) if taken_at is not None else (t_end - t_pass)), t_end - t0

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

    def clear_pass(self) -> None:
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

    def free(self, slot: int) -> None:
        """A judged or released request's slot: free now, at the step's end, or after the
        next read pass (see the class)."""
        if self.zero_on_free and self.defer_clears:
            self.quarantine.append(slot)
            return
        if self.zero_on_free:
            self.to_clear.append(slot)
        self.slots.free(slot)

    def zero_freed(self) -> None:
        """End of a step: zero the rooms of the slots freed in it."""
        if self.to_clear:
            self.buffers.clear_slots(self.to_clear)
            self.to_clear = []
            if not self.host_rows:
                # Device rows: the zeroing is a kernel on this process's stream, and a freed
                # slot is granted after this; the next owner's row, written by the prefill's
                # engine outside this stream, must not land before the zero does (once a
                # step, not per request).
                self.buffers.sync()


class Judge:
    """The judging rules, on one rank's row of a request; a TP group's ranks each judge their
    own and agree (orchestrator.endpoints.tp)."""

    def __init__(self, cfg: OrchestratorConfig, buffers, digest: RowDigest, res: DecodeResult):
        self.buffers, self.digest, self.res = buffers, digest, res
        self.timeout_s = cfg.transport.timeout_s
        self.readiness = cfg.gate.readiness
        self.settle_s = cfg.gate.settle_ms / 1e3

    def poll(self, g: Grant, r, now: float) -> int:
        """This rank's KVPoll of a request: Transferring with no status yet (no row read) or
        while the readiness gate holds its row, Failed as its sender said, else Success."""
        if r is None:
            return int(KVPoll.Transferring)
        if g.status == KVPoll.Failed:
            return int(KVPoll.Failed)
        if self.unready(g, r, now):  # the gate: "done", but this row has not landed
            return int(KVPoll.Transferring)
        return int(KVPoll.Success)

    def verdict(self, g: Grant, r, agreed: int, now: float) -> Optional[tuple[Outcome, Detail]]:
        """The verdict on a request polled `agreed` (a TP group: every rank's MIN), None while
        it waits: Failed fails it (a sender error, or another rank's: TP divergence); Success
        judges the row; "done" with the room still 0 past transport.timeout_s fails it."""
        if agreed == KVPoll.Failed:
            return Outcome.failed, Detail.sender_error if g.status == KVPoll.Failed else Detail.tp_disagreement
        if agreed == KVPoll.Success:  # taken (the gate passed); the verdict once the digest is compared
            return self.judge(g, r)
        if r is not None and r.room == 0 and now - g.t_status > self.timeout_s:
            return Outcome.failed, Detail.room_never_landed
        return None

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

    def judge(self, g: Grant, r) -> tuple[Outcome, Detail]:
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


def _forward_loop(cfg: OrchestratorConfig, buffers, host_rows: bool, index: int, log):
    """endpoints.decode_load: the forward loop on the decode GPU (None when off, or with no
    CUDA device: then with a warning). `index`: this process among the decode processes."""
    if cfg.endpoints.decode_load.step_ms <= 0:
        return None
    import torch

    e = cfg.endpoints
    # the decode GPU decodes whatever the aux rows' device: host rows (the gate reads
    # host memory) against CUDA rows (it reads behind the queued forward)
    gpu = buffers.device if not host_rows else (
        torch.device("cuda", (e.decode_gpus or [0])[index % len(e.decode_gpus or [0])])
        if torch.cuda.is_available() else None)
    if gpu is None:
        log.warning("decode_load_off", detail="endpoints.decode_load needs a CUDA device: "
                    "none here, running without a forward loop")
        return None
    from orchestrator.handoff.endpoints.load import ForwardLoop

    torch.cuda.set_device(gpu)  # host rows: this process's only CUDA work
    with torch.cuda.device(gpu):
        load = ForwardLoop(gpu, e.decode_load.step_ms)
        load.measure_idle(e.decode_load.idle_s)  # before serving: no handoffs
    log.info("decode_load", step_ms=e.decode_load.step_ms, device=str(gpu),
             matmuls_per_step=load.matmuls, gate_read=cfg.gate.read.value,
             forward_steps_per_s_idle=load.idle_per_s)
    return load


class DecodeEndpoint:
    def __init__(self, cfg: OrchestratorConfig, plan: Plan, run_dir: Path, log, secret: bytes,
                 instance: int = 0, tp_rank: int = 0, group: Optional[Group] = None):
        self.cfg, self.plan, self.log = cfg, plan, log
        e = cfg.endpoints
        self.name = proc_name("decode", instance, e.decode_ranks, tp_rank, e.decode_tp)
        self.tp_rank = tp_rank
        self.side = build_side(cfg.buffers, cfg.layout, cfg.transport, plan, self.name, run_dir, log,
                               process_gpu(plan, "decode", instance * e.decode_tp + tp_rank))
        self.buffers = self.side.buffers
        self.layout = describe(self.buffers.specs)
        self.ptrs, _, self.item_lens = self.buffers.get_buf_infos()
        self.slots = SlotAllocator(cfg.buffers.size)
        self.peers = Peers(secret, cfg.transport.timeout_s)
        self.digest = RowDigest(self.buffers, self.peers.keys, cfg.verify.digest)
        self.buffers.warm()  # start-up pays the device's first-use costs, not request 1
        self.digest.warm()
        self.timeout_s = cfg.transport.timeout_s
        self.group = group or single()
        self.ledger = Ledger(cfg.buffers.size)
        self.notices = Notices()
        self.res = DecodeResult(self.name, tp_rank=self.tp_rank)
        self.judge = Judge(cfg, self.buffers, self.digest, self.res)
        self.records = open(RunFiles(run_dir).verdicts(self.name), "w", buffering=1 << 16)
        # gate.read: how the readiness gate reads rooms on device rows (host rows: a plain read)
        self.rows = Rows(self.buffers, self.digest, self.slots, cfg.gate.read,
                         decode_setup(self.buffers, cfg.faults, cfg.gate.zero_room_on_free), self.group.size == 1)
        self.load = _forward_loop(cfg, self.buffers, self.rows.host_rows, instance * e.decode_tp + tp_rank, log)
        self.net = Sockets(cfg, wire.max_frame_bytes(self.item_lens, cfg.buffers.size))

    @property
    def leader(self) -> bool:
        return self.group.rank == 0

    @property
    def session_id(self) -> Optional[str]:
        """The engine session advertised at bootstrap (silent_peer: a port that never answers)."""
        if self.net.silent is not None:
            return "%s:%d" % self.net.silent.getsockname()
        return self.side.engine.session_id if self.side.engine else None

    # ---- control plane (hello on every rank; the rest on the leader) ----------------------
    def on_control(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._drop("dropped_control", "control_dropped", error="no payload frame")
            return
        identity = frames[0]
        sess = self.peers.sessions.get(identity)
        try:
            body = (sess.auth if sess is not None else self.peers.auth).unseal(frames[1]) \
                if len(frames) == 2 else None
        except Replayed as exc:
            assert sess is not None  # only a session's unseal raises Replayed
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
            self.peers.heard[prank] = _clock()
        if kind == "hello":
            self._hello(identity, sess, msg)
        elif sess is None:  # authentic under the bare secret, but only hello may be
            self._drop("rejected_auth", "control_rejected", reason=f"{kind} outside a session")
        elif kind == "arrive" and self.leader:
            self.peers.started.add(sess.rank)
            self._arrive(sess.rank, msg)
        elif kind == "bye" and self.leader:
            self.peers.done.add(sess.rank)
            self.release_prefill(sess.rank, "bye")
            self.notices.byes.append(sess.rank)
        else:
            self._drop("dropped_control", "control_dropped", error=f"{kind} is not for this rank")

    def _arrive(self, prank: int, msg: dict) -> None:
        """Arrivals wait for a slot (and are granted what is free); past the waiting cap one
        is shed, failed at once as decode_overloaded."""
        led = self.ledger
        for rid, room in msg["reqs"]:
            if len(led.waiting) >= led.waiting_cap:  # shed, and say so
                self._drop("dropped_control", "arrival_shed",
                           error=f"{len(led.waiting)} arrivals already wait for a slot")
                now_ns = time.monotonic_ns()
                led.verdicts[prank].append([rid, Outcome.failed.code, Detail.decode_overloaded.code,
                                            now_ns, now_ns, 0])
                continue
            led.waiting.append((prank, rid, room, msg["contiguous"]))
        self.grant_waiting()

    def _hello(self, identity: bytes, sess: Optional[PrefillSession], msg: dict) -> None:
        """The first authentic hello of a rank binds it to this connection; any other hello
        for a bound rank (a copy replayed from anywhere, or a second one) is refused."""
        rank = msg["rank"]
        peers = self.peers
        bound = peers.ranks.get(rank)
        if bound is not None or sess is not None:
            self._drop("hijack_refused", "hello_refused", prefill=rank,
                       detail="rank already bound to another connection" if bound is not None
                       and bound.identity != identity else "hello again on a bound connection")
            return
        diff = first_difference(self.layout, msg["layout"])
        if diff is not None:
            self.log.error("layout_mismatch", prefill=rank, detail=diff)
            self._refuse(identity, rank, f"layout mismatch: {diff}")
            return
        why = same_process_space_rule(self.plan.engine_transport, (peers.pid_ns, peers.boot_id),
                                      (msg.get("pid_ns", ""), msg.get("boot_id", "")))
        if why is not None:  # refused before any byte moves, on both sides
            self.log.error("process_space_mismatch", prefill=rank, detail=why)
            self._refuse(identity, rank, why)
            return
        keys = Keys(peers.secret, msg["nonce"])
        new = PrefillSession(rank, identity, peers.auth.session(rank, msg["nonce"], peers.nonce, "decode"),
                             keys, _clock())
        self.digest.rank_keys[rank] = keys
        # the answer goes under the secret (the prefill needs our nonce to derive the session)
        self._reply(identity, wire.encode(
            "bootstrap", session_id=self.session_id, aux_ptrs=self.ptrs, item_lens=self.item_lens,
            slots=self.cfg.buffers.size, layout=self.layout, fingerprint=msg["fingerprint"],
            tp_rank=self.tp_rank, boot_id=peers.boot_id, scratch_ptr=self.buffers.scratch_ptr,
            nonce=peers.nonce, hello_nonce=msg["nonce"], pid_ns=peers.pid_ns))
        peers.bind(new)
        self.log.info("prefill_bound", prefill=rank)

    def _refuse(self, identity: bytes, rank: int, why: str) -> None:
        """Refused at hello: the prefill is told; the leader tells the runner too."""
        self._reply(identity, wire.encode("error", detail=why))
        if self.leader:
            self.notices.refused.append((rank, why))

    def grant_waiting(self) -> None:
        """Grant slots to waiting arrivals, in order. Arrivals marked contiguous get
        consecutive slots (continuing after the prefill's previous grant when it can), so a
        coalesced send covers them with one block per field."""
        led = self.ledger
        while led.waiting and self.slots.available:
            prank, rid, room, contiguous = led.waiting[0]
            n = 1
            if contiguous:
                while (n < len(led.waiting) and n < self.slots.available
                       and led.waiting[n][0] == prank and led.waiting[n][3]):
                    n += 1
                slots = self.slots.alloc_run(n, led.next_slot.get(prank))
                led.next_slot[prank] = slots[-1] + 1
            else:
                slot = self.slots.alloc()
                assert slot is not None  # (slots available)
                slots = [slot]
            for slot in slots:
                prank, rid, room, _ = led.waiting.popleft()
                if (prank, rid) in led.grants:
                    self.slots.free(slot)
                    self._drop("unexpected", "duplicate_arrival", prefill=prank, rid=rid)
                    continue
                g = Grant(prank, rid, room, slot, self.peers.pad(prank, rid), _clock(),
                          shared=self.group.size == 1)
                self._add(g)
                if self.group.size > 1:  # one rank has no one to share it with
                    led.new_grants.append(g)
                led.granted[prank].append(g)

    def _add(self, g: Grant) -> None:
        self.ledger.add(g)
        self.res.grants += 1

    def adopt_grant(self, prank: int, rid: int, slot: int, room: int) -> Grant:
        """A TP follower learns a grant its leader made (the same slot in its own buffers)."""
        self.slots._take(slot)
        g = Grant(prank, rid, room, slot, self.peers.pad(prank, rid), _clock())
        self._add(g)
        return g

    def release_prefill(self, prank: int, why: str) -> None:
        """A prefill that said bye (or died) writes nothing more: its slots go back (in a TP
        group, on every rank at the next step)."""
        led = self.ledger
        if self.group.size > 1:
            if self.leader:
                led.pending_releases.append(prank)
            return
        gone = led.of(prank)
        for g in gone:
            self._remove(g)
        self._flush()
        led.waiting = collections.deque(w for w in led.waiting if w[0] != prank)
        if gone:
            self.log.info("grants_released", prefill=prank, count=len(gone), why=why)
        self.grant_waiting()

    def _reply(self, identity: bytes, payload: bytes) -> None:
        sess = self.peers.sessions.get(identity)
        auth = sess.auth if sess is not None else self.peers.auth
        try:
            self.net.control.send_multipart([identity, auth.seal(payload)])
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
        due = [s for s in self.peers.ranks.values() if now - s.told >= self.peers.heartbeat_s]
        if not due:
            return
        waiting = {g.prank for g in self.ledger.grants.values()} | {w[0] for w in self.ledger.waiting}
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
                found = [self.ledger.by_slot.get(slot + k) for k in range(min(rows, self.cfg.buffers.size))]
                gs = [g for g in found if g is not None]
                if not found or len(gs) != len(found):
                    return None, b""
                sess = self.peers.ranks.get(gs[0].prank)
                return (sess.auth if sess else None), b"".join(g.rid.to_bytes(8, "little") for g in gs)
            rank = int(frames[1] if frames[0] == wire.STEP else frames[2])
        except (IndexError, ValueError, ZeroDivisionError):
            return None, b""
        sess = self.peers.ranks.get(rank)
        return (sess.auth if sess else None), b""

    def on_data(self, frames: list[bytes]) -> None:
        auth, ad = self._data_auth(frames) if frames else (None, b"")
        body = auth.open(frames, ad) if auth is not None else None
        if body is None and not self.peers.auth.enabled:  # no secret (interop tests): nothing to check
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
        if self.plan.route.value != "tcp" or not self.rows.host_rows:
            self._drop("unexpected", "aux_data_on_engine_route", slot=msg.slot)
            return
        by_slot = self.ledger.by_slot
        first = by_slot.get(msg.slot)
        if first is None or first.room != msg.room or any(
                (msg.slot + k) not in by_slot for k in range(msg.rows)):
            self._drop("unexpected", "frame_for_ungranted_slot", slot=msg.slot, room=msg.room)
            return
        wire.write_rows(self.ptrs, self.item_lens, msg)

    def _status(self, prank: int, room: int, status: int, rid: Optional[int], slot: Optional[int],
                tag: int, reason: str) -> None:
        self.peers.heard[prank] = _clock()
        g: Optional[Grant]
        if rid is None:  # a bare SGLang status: only its room identifies the request
            found = [g for g in self.ledger.grants.values() if g.prank == prank and g.room == room]
            if len(found) != 1:
                self._drop("ambiguous" if found else "unexpected", "status_without_identity",
                           prefill=prank, room=room, matches=len(found))
                return
            g = found[0]
        else:
            g = self.ledger.grants.get((prank, rid))
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
        self.ledger.ready[(g.prank, g.rid)] = g

    def _drop(self, counter: str, event: str, **kw) -> None:
        """Count a message not acted on; log the first few of each kind, then every 1000th."""
        n = getattr(self.res, counter) + 1
        setattr(self.res, counter, n)
        if n <= 5 or n % 1000 == 0:
            self.log.warning(event, count=n, **kw)

    # ---- one step: poll -> agree -> judge -> agree -> finish ----------------------------
    def step(self) -> None:
        """One decode step: poll the requests with a status, agree on the polls, judge what
        was agreed on this rank's rows, agree on the verdicts, finish them. One rank agrees
        with itself; a TP group (every step, in lockstep) polls every grant, in the shared
        order, and judges at the time it agreed."""
        self._share()
        lockstep = self.group.size > 1
        if not lockstep and not self.ledger.ready:
            if self.rows.quarantine and (self.ledger.waiting
                                         or 4 * len(self.rows.quarantine) >= self.cfg.buffers.size):
                self.rows.clear_pass()  # slots are wanted: a pass of its own
                self._flush()
            return
        t0 = time.perf_counter()
        if lockstep:
            cands = list(self.ledger.grants.values())
            rows, taken_at = self.rows.read_plain(cands), None
        else:
            cands = list(self.ledger.ready.values())
            rows, taken_at, gate_s, stall_s = self.rows.read_pass(cands, t0)
            self.res.gate_read_us.add(gate_s * 1e6)
            self.res.stall_us.add(stall_s * 1e6)
        now, now_ns = _clock(), time.monotonic_ns()
        polls = [self.judge.poll(g, r, now) for g, r in zip(cands, rows)]
        agreed = self.group.agree_polls(polls)
        if lockstep:  # the group judges at the time it agreed
            now, now_ns = _clock(), time.monotonic_ns()
        own, waits = self._own_verdicts(cands, rows, agreed, now, now_ns, taken_at)
        worst = self.group.agree_verdicts([NOT_TAKEN if v is None else v.code for v in own])
        for g, v, code in zip(cands, own, worst):
            if code != NOT_TAKEN:
                assert v is not None  # every rank took the same positions (TorchGroup.agree_verdicts)
                self._finish(g, Outcome.of(code // 256), Detail.of(code % 256), v.t_ns,
                             own=(v.outcome, v.detail), t_taken_ns=v.t_taken_ns)
        if lockstep:  # the TP log's counts (one rank keeps none)
            taken = [v for v in own if v is not None]
            self.group.tally(read=sum(r is not None for r in rows), took=len(taken), waits=waits,
                             unready=sum(v.detail is Detail.taken_unready for v in taken),
                             wrong_room=0 if self.judge.readiness else
                             sum(v.detail is Detail.room_mismatch for v in taken))
        else:
            self.res.gate_waits += waits
            self.res.verify_us.add((time.perf_counter() - t0) * 1e6)
            self.res.batch.add(len(cands))
        self.res.steps += 1
        self._flush()

    def _own_verdicts(self, cands: list[Grant], rows: list, agreed: list[int], now: float, now_ns: int,
                      taken_at: Optional[dict[int, int]]) -> tuple[list[Optional[Verdict]], int]:
        """This rank's verdict on each candidate (None: not this step) and how many the gate
        holds. Times: a TP group's verdicts carry the agreed step's; one rank's, when each was
        judged and taken (the sglang gate's read, else the step's), failures never taken."""
        out: list[Optional[Verdict]] = []
        waits = 0
        lockstep = self.group.size > 1
        for g, r, a in zip(cands, rows, agreed):
            v = self.judge.verdict(g, r, a, now)
            if v is None:
                out.append(None)
                if r is not None:
                    waits += 1
            elif lockstep:
                out.append(Verdict(*v, now_ns, now_ns))
            elif a == KVPoll.Success:
                taken = taken_at.get(g.slot, now_ns) if taken_at is not None else now_ns
                out.append(Verdict(*v, time.monotonic_ns(), taken))
            else:
                out.append(Verdict(*v, now_ns, 0))
        return out, waits

    def _share(self) -> None:
        """The leader's grants and releases since the last step, on every rank (a TP group's
        ranks then hold the same grants, in the same order)."""
        if self.group.size == 1:  # its grants are shared when made, its releases done at once
            return
        led = self.ledger
        grants, releases = self.group.share([(g.prank, g.rid, g.slot, g.room) for g in led.new_grants],
                                            list(led.pending_releases))
        if self.leader:
            for g in led.new_grants:
                g.shared = True  # every rank knows it now: the prefill may be told
        else:
            for prank, rid, slot, room in grants:
                self.adopt_grant(prank, rid, slot, room)
        for prank in releases:
            for g in led.of(prank):
                self._remove(g)
        led.new_grants.clear()
        led.pending_releases.clear()

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
            self.ledger.verdicts[g.prank].append([g.rid, outcome.code, detail.code, t_ns,
                                                  int(g.t_status * 1e9), t_taken_ns])
        self.records.write(f'{{"prefill": {g.prank}, "rid": {g.rid}, "outcome": "{mine.value}", '
                           f'"detail": "{why.value}"}}\n')
        self._remove(g)
        if self.res.judged == _WARM:
            self.res.memory["rss_kb_warm"] = rss_kb()

    def _remove(self, g: Grant) -> None:
        self.ledger.drop(g)
        self.rows.free(g.slot)

    def _flush(self) -> None:
        """End of a step: zero the freed rooms, send the verdicts, grant what waits."""
        self.rows.zero_freed()
        led = self.ledger
        if self.leader and led.waiting:
            self.grant_waiting()
        for prank in set(led.verdicts) | set(led.granted):
            told = [g for g in led.granted.get(prank, []) if g.shared]
            v = led.verdicts.pop(prank, [])
            if told or v:
                self._reply(self.peers.ranks[prank].identity,
                            wire.encode("update", grants=[[g.rid, g.slot] for g in told], v=v))
            left = [g for g in led.granted.get(prank, []) if not g.shared]
            if left:
                led.granted[prank] = left
            else:
                led.granted.pop(prank, None)

    # ---- loop ---------------------------------------------------------------------------
    def serve(self, chan: protocol.Channel) -> None:
        """Take messages and step until the runner says stop (a TP group: until any rank
        was told to, all together)."""
        poller = zmq.Poller()
        poller.register(self.net.control, zmq.POLLIN)
        poller.register(self.net.data, zmq.POLLIN)
        poller.register(chan.fileno(), zmq.POLLIN)
        lockstep = self.group.size > 1
        spin = self.cfg.endpoints.poll.spins()
        watch = self.cfg.role is Role.decode and self.leader  # role=both: the runner watches them
        self.log.info("decode_loop", poll="spin" if spin else "block")
        load = self.load
        if load is not None:
            load.start()
        while True:
            if load is not None:
                load.tick()  # the next forward is queued before the poll, as SGLang's overlap scheduler does
            events = dict(poller.poll(0 if spin or load else 1 if (self.ledger.ready or lockstep) else 50))
            self._take(events)
            self.step()
            if self.ledger.verdicts or any(g.shared for gs in self.ledger.granted.values() for g in gs):
                self._flush()
            if self.leader:
                self.heartbeat()
            if watch:
                self._watch_prefills()
            self.notices.send(chan)
            stop = chan.fileno() in events and chan.poll() and self._on_pipe(chan.recv())
            stop = stop or Stop.requested
            if lockstep:
                stop = self.group.any(stop)
            if stop:
                self.res.memory["rss_kb_end"] = rss_kb()
                if load is not None:
                    self.res.load = load.summary(self.cfg.endpoints.decode_load.step_ms)
                if lockstep:
                    assert isinstance(self.group, TorchGroup)  # (size > 1)
                    self.res.tp = self.group.summary()
                return

    def _take(self, events: dict) -> None:
        """What arrived: up to 1024 control messages, then up to 4096 data frames."""
        for sock, handle, most in ((self.net.control, self.on_control, 1024), (self.net.data, self.on_data, 4096)):
            if sock in events:
                for _ in range(most):
                    try:
                        handle(sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break

    def _on_pipe(self, msg) -> bool:
        """A message from the runner; True for Stop."""
        match msg:
            case protocol.Stop():
                return True
            case protocol.PrefillGone(rank=rank):
                self.release_prefill(rank, "prefill process gone")
                return False
            case _:
                raise protocol.ProtocolError(f"a decode does not take {type(msg).__name__}")

    def _watch_prefills(self) -> None:
        """role=decode: a prefill rank whose loop runs (or that holds granted slots) and has
        sent nothing for transport.timeout_s is lost, and so is one bound at hello whose loop
        never started within endpoints.startup_timeout_s (the runner on this host cannot see
        its process; a live loop says something at least every min(1 s, timeout_s/4))."""
        now = _clock()
        peers = self.peers
        if now - peers.watched_at < peers.heartbeat_s:  # nobody can have gone silent since
            return
        if now - peers.watched_at > self.timeout_s / 2:  # WE were stalled: nobody could be heard
            peers.heard = {rank: now for rank in peers.heard}
        peers.watched_at = now
        running = {g.prank for g in self.ledger.grants.values()} | peers.started
        for prank, last in list(peers.heard.items()):
            if prank in peers.done:
                continue
            limit, what = ((self.timeout_s, "transport.timeout_s") if prank in running else
                           (self.cfg.endpoints.startup_timeout_s, "endpoints.startup_timeout_s"))
            if now - last > limit:
                why = (f"prefill rank {prank} silent for {what}={limit:g}" if prank in running else
                       f"prefill rank {prank} bound at hello, its loop not started within {what}={limit:g}")
                self.log.error("prefill_lost", prefill=prank, detail=why)
                peers.done.add(prank)
                self.release_prefill(prank, why)
                self.notices.lost.append((prank, why))

    def close(self) -> None:
        self.group.close()
        self.records.close()
        self.net.close()


def _join(cfg: OrchestratorConfig, plan: Plan, chan: protocol.Channel, run_path: Path, name: str,
          instance: int, tp_rank: int) -> Optional[Group]:
    """A decode TP rank joins its instance's group at the rendezvous the runner sends
    (endpoints.decode_tp=1: no group)."""
    e = cfg.endpoints
    if e.decode_tp == 1:
        return None
    from orchestrator.handoff.endpoints.tp import join

    match chan.recv():
        case protocol.Rendezvous() as rendezvous:
            pass
        case other:
            raise protocol.ProtocolError(f"a decode TP rank waits for Rendezvous, not {type(other).__name__}")
    return join(plan, rendezvous, tp_rank, e.decode_tp, cfg.transport.timeout_s,
                process_gpu(plan, "decode", instance * e.decode_tp + tp_rank), run_path / f"tp-{name}.jsonl")


def decode_main(cfg: OrchestratorConfig, plan: Plan, run_dir: str, secret: bytes, conn,
                instance: int = 0, tp_rank: int = 0, bulk_bytes: int = 0) -> None:
    """Process entry (multiprocessing spawn) of one decode process; `conn` is its end of the
    runner's pipe (orchestrator.protocol). `bulk_bytes` > 0 also registers a bulk target
    region of that size on the buffers' device (the benchmark's bandwidth point)."""
    run_path = Path(run_dir)
    e = cfg.endpoints
    chan = protocol.Channel(conn)
    name = proc_name("decode", instance, e.decode_ranks, tp_rank, e.decode_tp)
    log = start_process(name, run_path, cfg.logging.console)
    endpoint = None
    try:
        group = _join(cfg, plan, chan, run_path, name, instance, tp_rank)
        endpoint = DecodeEndpoint(cfg, plan, run_path, log, secret, instance, tp_rank, group)
        info: dict[str, Any] = {
            "control_endpoint": endpoint.net.control_endpoint,
            "data_endpoint": endpoint.net.data_endpoint,
            "transport": endpoint.side.transport,
            "session_id": endpoint.session_id,
            "engine_exposed": exposed(listening_sockets()) if endpoint.side.engine else [],
        }
        if bulk_bytes and endpoint.side.engine is not None:
            import torch

            bulk = torch.empty(bulk_bytes, dtype=torch.uint8, device=endpoint.buffers.device)
            endpoint.side.engine.register(bulk.data_ptr(), bulk_bytes)
            info["bulk_ptr"] = bulk.data_ptr()
        chan.send(protocol.Ready(info))
        endpoint.serve(chan)
        chan.send(protocol.Stats(endpoint.res))
    except Exception as exc:  # reported to the runner, which owns the user-facing message
        line = report_failure(log, "decode_failed", exc)
        try:
            chan.send(protocol.Error(line))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if endpoint is not None:
            endpoint.close()
