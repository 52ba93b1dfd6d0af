"""The cost ladder's own prefill/decode pair (rungs R0-R5 of orchestrator.sweep.ladder).

One pair of processes (forked warm, as the run's endpoints are: job.warmstart) moves N rows one in flight with
this project's own pieces, each rung adding one component to the one below:

  R0  the yardstick's loop (../shared/tools/handoff_yardstick.py) from our pieces: our
      MooncakeEngine's batch write of the row (our MetadataBuffers, filled ahead, tags taken
      per slot before timing), a 24-byte status (slot, room, tag) over a ZMQ PAIR, the decode's
      check on the rows' device (RowDigest.read of the landed row against the status's tag),
      a 16-byte verdict back
  R1  + our authenticated frames: the status as the run sends it, one status frame of one
      entry (rid, room, slot, status, tag) with its MAC inside, under the pair's session keys
      (wire.status_frame, Session.sign_frame, one send) on a PUSH -> PULL data socket, its MAC
      checked and parsed strictly (Session.open_frame, wire.parse); the verdict a sealed
      UpdateMsg (Session.seal)
  R2  + our seal: per request the room written and the keyed digest taken and its tag written
      (RowDigest.seal of rows filled ahead, as the run's loop does with workload.fill=ahead:
      SGLang's bootstrap_room[slot, 0] = room and kv_checksum, one indexed write; the keyed tag
      from the frozen sums), the decode checking room and tag of what landed and zeroing the
      previous slot's room in the same read
  R3  + the readiness gate as configured: the decode reads through endpoints.judge.Rows
      (gate.read, zero_room_on_free) and judges with endpoints.judge.Judge (gate.readiness,
      gate.settle_ms), a held row read again until the gate lets it through
  R4  + the send path as the run composes it: the prefill's step goes through
      endpoints.sender.Sender as the run's loop hands it over, alone in flight (submit: the
      write started; pump: waited for, the status behind it, the finished step handed back,
      on the loop's own thread: no hop to the transfer thread, which is up and idle as in the
      run), and our send path (AuxRouter: start, finish, after_send)
  R5  + slot grants: each request announced (sealed ArriveMsg on a DEALER -> ROUTER control
      channel), its slot granted by the decode's SlotAllocator (sealed UpdateMsg grants), the
      prefill's source slot from its own SlotAllocator, the decode's Grant table looked up by
      (rank, request) per status; the verdict on the control channel. The arrive -> grant round
      trip is before the row is ready (outside the timed span), as in the run.

Timed per handoff: row ready (before the seal) -> verdict received on the prefill. Every
handoff's bytes are verified: the decode counts verified and not, the prefill counts verdicts
that say verified. Nothing here is on the run's hot path.
"""

from __future__ import annotations

import os
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple, Optional

import structlog
import torch
import zmq

from orchestrator.handoff.backends.base import Peer, SendPath, Transfer
from orchestrator.handoff.backends.mooncake.backend import MooncakeBackend
from orchestrator.handoff.backends.mooncake.engine import MooncakeEngine
from orchestrator.handoff.buffers import WARM_BYTES, MetadataBuffers, SlotAllocator
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.endpoints.common import SWITCH_INTERVAL_S, Side, build_side, process_gpu, shapes
from orchestrator.handoff.endpoints.decode_state import Grant
from orchestrator.handoff.endpoints.judge import Judge, Rows
from orchestrator.handoff.endpoints.links import Link, Req
from orchestrator.handoff.endpoints.sender import ForwardStep, Sender
from orchestrator.handoff.specs import GateSpec, SideSpec, WorkloadSpec
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, Session, new_nonce
from orchestrator.handoff.workload import RequestPool, room_of
from orchestrator.profile.config import (
    CompletionSetting,
    DigestKind,
    FillMode,
    PollMode,
    TransportConfig,
)
from orchestrator.profile.plan import Plan
from orchestrator.profile.platform import usable_cores
from orchestrator.results.logs import configure
from orchestrator.results.outcomes import Detail, KVPoll, Outcome
from orchestrator.results.records import DecodeResult

RAW_STATUS = struct.Struct("<qqq")  # R0: slot, room, tag
RAW_VERDICT = struct.Struct("<qq")  # R0: slot, ok
BYE = b"bye"
SUCCESS = int(KVPoll.Success)
WARM = 50  # untimed handoffs first, as the yardstick's


@dataclass(frozen=True)
class PairSpec:
    """What the pair reads, built once by the ladder's entry (orchestrator.bench) from the
    ladder's profile (one in flight, rows filled ahead): the plan, the handoff pieces' specs it
    composes (side: buffers, layout and engine; workload; gate), the transport section and the
    values it reads itself. It crosses into both processes of every pair."""

    plan: Plan
    side: SideSpec  # the buffers, their layout and the engine (build_side)
    transport: TransportConfig  # host, timeout_s, the send path's sizes
    workload: WorkloadSpec  # the synthetic rows and their rooms
    gate: GateSpec  # the decode's readiness gate (R2+)
    digest: DigestKind  # verify.digest
    poll: PollMode  # endpoints.poll
    handoffs: int  # bench.ladder_handoffs: timed, after WARM untimed


def _sock(ctx: zmq.Context, kind: int, max_bytes: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    return s


def _setup(role: str, spec: PairSpec, run_dir: str) -> tuple[Side, MetadataBuffers]:
    torch.set_num_threads(1)  # as the endpoints (common.start_process)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log = configure(Path(run_dir), role)
    side = build_side(spec.side, spec.plan, role, Path(run_dir), log,
                      process_gpu(spec.plan, role, 0))
    return side, side.buffers


def _log() -> Any:
    return structlog.get_logger("orchestrator")


def _send_error(role: str, conn: Connection, exc: BaseException) -> None:
    """The side's error to the parent, and its last log line (what the parent quotes when the
    pipe is gone too)."""
    line = f"{role}: {type(exc).__name__}: {exc}"
    try:
        _log().error("ladder_side_failed", error=line.splitlines()[0])
    except Exception:  # noqa: BLE001 - the pipe below still says it
        pass
    conn.send(("error", f"{line}\n{traceback.format_exc()}"))


def _recv(sock: zmq.Socket, spin: bool, multipart: bool = False) -> Any:
    """The next message: busy-polled (spin, as the yardstick on a GPU host) or blocking."""
    if not spin:
        return sock.recv_multipart() if multipart else sock.recv()
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK) if multipart else sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            continue


def _flip(b: MetadataBuffers, slot: int) -> None:
    """One byte of a digested field's row changed (again: restored), landed before the write."""
    field = next(f for f in range(len(b.item_lens)) if f not in (b.room_field, b.checksum_field))
    b.flip_byte(slot, field)
    b.sync()


# ---- decode --------------------------------------------------------------------------------
def decode_main(rung: int, spec: PairSpec, run_dir: str, secret: bytes, conn: Connection) -> None:
    try:
        d = _decode_setup(spec, run_dir, secret, conn)
        conn.send(("ready", None))
        res = _decode_raw(d) if rung == 0 else _decode_granted(d) if rung >= 5 else _decode_framed(rung, d)
        _log().info("ladder_decode_end", reason="bye", **res)
        conn.send(("result", res))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        _send_error("decode", conn, exc)


@dataclass
class _Decode:
    """The decode's pieces, set up before it says it is ready; each rung's loop takes what it
    composes (R0 the PAIR and the digest, R1+ the data socket and the session, R2+ the judge,
    R3+ the rows and their gate, R5 the control channel and the slot grants)."""

    side: Side  # its engine with the buffers registered: held for the pair's life
    b: MetadataBuffers
    spin: bool
    keys: Keys
    digest: RowDigest
    session: Session
    slots: SlotAllocator
    rows: Rows
    judge: Judge
    pads: list[tuple[int, int]]  # R0/R1: tags taken per slot
    pair: zmq.Socket
    pull: zmq.Socket
    ctl: zmq.Socket
    poller: zmq.Poller  # R5 without spinning: the control channel and the data socket
    zero_room_on_free: bool  # gate.zero_room_on_free (R2)


def _decode_setup(spec: PairSpec, run_dir: str, secret: bytes, conn: Connection) -> _Decode:
    """Buffers and engine up, sockets bound, infos swapped with the prefill, digest and gate built."""
    side, b = _setup("decode", spec, run_dir)
    spin = spec.poll.spins(usable_cores())
    ctx = zmq.Context()
    host = spec.transport.host
    limit = wire.max_frame_bytes(b.item_lens, b.size)
    pair = _sock(ctx, zmq.PAIR, limit)
    pull = _sock(ctx, zmq.PULL, limit)
    ctl = _sock(ctx, zmq.ROUTER, limit)
    addrs = {name: f"tcp://{host}:{s.bind_to_random_port(f'tcp://{host}')}"
             for name, s in (("pair", pair), ("pull", pull), ("ctl", ctl))}
    nonce = new_nonce()
    ptrs, _, lens = b.get_buf_infos()
    conn.send(("info", {"session_id": side.backend.session_id, "aux_ptrs": ptrs,
                        "item_lens": lens, "slots": b.size, "scratch_ptr": b.scratch_ptr,
                        "nonce": nonce, **addrs}))
    peer = conn.recv()
    keys = Keys(secret, peer["nonce"])
    digest = RowDigest(b, keys, spec.digest)
    b.warm()
    digest.warm()
    session = Authenticator(secret).session(0, peer["nonce"], nonce, "decode")
    slots = SlotAllocator(b.size)
    rows = Rows(b, digest, slots, spec.gate.read, spec.gate.zero_room_on_free)
    judge = Judge(spec.gate, spec.transport.timeout_s, b, digest, DecodeResult("decode"))
    poller = zmq.Poller()
    poller.register(ctl, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    return _Decode(side, b, spin, keys, digest, session, slots, rows, judge, [keys.pad(0, s) for s in range(b.size)],
                   pair, pull, ctl, poller, spec.gate.zero_room_on_free)


def _decode_raw(d: _Decode) -> dict[str, Any]:
    """R0: the raw status on the PAIR, the row's tag checked, the raw verdict back."""
    pair, spin, digest, pads = d.pair, d.spin, d.digest, d.pads
    verified = bad = 0
    while True:
        m = _recv(pair, spin)
        if m == BYE:
            return {"verified": verified, "bad": bad, "held": 0}
        slot, room, tag = RAW_STATUS.unpack(m)
        r = digest.read([slot], [(0, slot)])[0]
        ok = digest.expected_tag(r, pads[slot]) == tag
        verified += ok
        bad += not ok
        pair.send(RAW_VERDICT.pack(slot, ok))


def _decode_framed(rung: int, d: _Decode) -> dict[str, Any]:
    """R1-R4: authenticated statuses on the data socket, sealed verdicts back on the PAIR;
    R1 checks the tag, R2 judges (room and tag, the previous slot's room zeroed in the same
    read), R3+ read through the readiness gate as configured."""
    b, spin, keys, digest, session, pads = d.b, d.spin, d.keys, d.digest, d.session, d.pads
    pull, pair, slots, rows, judge, zero_on_free = d.pull, d.pair, d.slots, d.rows, d.judge, d.zero_room_on_free
    verified = bad = held = 0
    last: Optional[int] = None  # R2: the previous slot, its room zeroed with this read
    while True:
        frames = _recv(pull, spin, multipart=True)
        if frames == [BYE]:
            return {"verified": verified, "bad": bad, "held": held}
        t_status = time.monotonic()
        st = _status(session, frames, b)
        if rung == 1:
            r = digest.read([st.slot], [(0, st.slot)])[0]
            ok = digest.expected_tag(r, pads[st.slot]) == st.tag
            outcome = Outcome.verified if ok else Outcome.corrupted
            detail = Detail.none if ok else Detail.checksum_mismatch
        elif rung == 2:
            clear = [last] if last is not None and last != st.slot and zero_on_free else []
            r = digest.read([st.slot], [(0, st.rid)], clear=clear)[0]
            last = st.slot
            g = Grant(0, st.rid, st.room, st.slot, keys.pad(0, st.rid), t_status, int(KVPoll.Success),
                      tag=st.tag, t_status=t_status)
            outcome, detail = judge.judge(g, r)
        else:  # R3+: the readiness gate as configured, through Rows and Judge
            slots.take(st.slot)
            g = Grant(0, st.rid, st.room, st.slot, keys.pad(0, st.rid), t_status, int(KVPoll.Success),
                      tag=st.tag, t_status=t_status)
            outcome, detail, waits = _gated(rows, judge, g)
            held += waits
        ok = outcome is Outcome.verified
        verified += ok
        bad += not ok
        t_ns = time.monotonic_ns()
        pair.send(session.seal(wire.encode(wire.UpdateMsg(grants=[], v=[[st.rid, outcome.code, detail.code, t_ns,
                                                                         int(t_status * 1e9), t_ns]]))))


class _Status(NamedTuple):
    rid: int
    room: int
    slot: int
    status: int
    tag: int


def _status(session: Session, frames: list[bytes], b: MetadataBuffers) -> _Status:
    """R1+: a received status frame as the run's decode takes it (DataPlane.on_data): its MAC
    checked under the session, then parsed strictly; its one entry."""
    body = session.open_frame(frames[0]) if len(frames) == 1 else None
    if body is None:
        raise RuntimeError("status with a bad MAC")
    st = wire.parse([body], b.item_lens, b.size)
    assert isinstance(st, wire.StepStatus) and len(st.entries) == 1, st
    return _Status(*st.entries[0])


def _gated(rows: Rows, judge: Judge, g: Grant) -> tuple[Outcome, Detail, int]:
    """R3-R5: the readiness gate as configured on one granted row (Rows and Judge, as the
    run's decode step uses them), its verdict, the slot freed and its room zeroed; with the
    number of passes the gate held the row."""
    held = 0
    while True:
        checks, _, _, _ = rows.read_pass([g], time.perf_counter())
        now = time.monotonic()
        polled = judge.poll(g, checks[0], now)
        if polled != KVPoll.Transferring:
            break
        held += 1
    v = judge.verdict(g, checks[0], polled, now)
    assert v is not None, "Success or Failed has a verdict"
    rows.free(g.slot)
    rows.zero_freed()
    return v[0], v[1], held


def _decode_granted(d: _Decode) -> dict[str, Any]:
    """R5: R4's judging, each request first announced on the control channel and granted a
    slot (SlotAllocator, the Grant table looked up per status); the verdict on the control
    channel. The control channel is read first: an arrival to grant, or the end."""
    b, spin, session, pull, ctl, poller, rows, judge = d.b, d.spin, d.session, d.pull, d.ctl, d.poller, d.rows, d.judge
    grants: dict[tuple[int, int], Grant] = {}
    verified = bad = held = 0
    ident: Optional[bytes] = None  # the prefill's ROUTER identity
    while True:
        if not spin:
            poller.poll(1000)
        while True:
            try:
                ident, raw = ctl.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if _control(d, grants, ident, raw):  # the prefill's bye
                return {"verified": verified, "bad": bad, "held": held}
        try:
            frames = pull.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            continue
        t_status = time.monotonic()
        st = _status(session, frames, b)
        g = grants.pop((0, st.rid))
        if g.slot != st.slot or g.room != st.room:
            raise RuntimeError(f"status for request {st.rid} names slot {st.slot}, granted {g.slot}")
        g.status, g.tag, g.t_status = int(KVPoll.Success), st.tag, t_status
        outcome, detail, waits = _gated(rows, judge, g)
        held += waits
        ok = outcome is Outcome.verified
        verified += ok
        bad += not ok
        t_ns = time.monotonic_ns()
        assert ident is not None
        ctl.send_multipart([ident, session.seal(wire.encode(wire.UpdateMsg(
            grants=[], v=[[st.rid, outcome.code, detail.code, t_ns, int(t_status * 1e9), t_ns]])))])


def _control(d: _Decode, grants: dict[tuple[int, int], Grant], ident: bytes, raw: bytes) -> bool:
    """R5: one control message: the prefill's bye (True), or requests announced, each granted
    a slot (the prefill waits for the grant before its row is ready: outside the timed span)."""
    body = d.session.unseal(raw)
    if body is None:
        raise RuntimeError("control message with a bad MAC")
    msg = wire.decode(body)
    if isinstance(msg, wire.ByeMsg):
        return True
    assert isinstance(msg, wire.ArriveMsg)
    out = []
    for rid, room in msg.reqs:
        slot = d.slots.alloc()
        assert slot is not None, "one in flight: a slot is always free"
        grants[(0, rid)] = Grant(0, rid, room, slot, d.keys.pad(0, rid), time.monotonic())
        out.append([rid, slot])
    d.ctl.send_multipart([ident, d.session.seal(wire.encode(wire.UpdateMsg(grants=out, v=[])))])
    return False


# ---- prefill -------------------------------------------------------------------------------
def prefill_main(rung: int, spec: PairSpec, run_dir: str, secret: bytes, conn: Connection,
                 corrupt: Optional[int] = None, hold_for: Optional[int] = None) -> None:
    """`corrupt` (tests): the timed handoff of this index has one byte of its source row changed
    after its seal and before its write (restored after its verdict): the decode must not
    verify it. `hold_for` (tests): the decode's pid; the result is sent only once that process
    is gone (ended and reaped by the parent), the order in which the parent must still take
    it."""
    try:
        res = _prefill(rung, spec, run_dir, secret, conn, corrupt)
        _log().info("ladder_prefill_end", n=res["n"], verified=res["verified"])
        if hold_for is not None:
            _wait_gone(hold_for)
        conn.send(("result", res))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        _send_error("prefill", conn, exc)


def _wait_gone(pid: int) -> None:
    """Until `pid` no longer exists (a zombie still does: gone means reaped)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.001)


def _verdict_ok(session: Session, raw: bytes, rid: int) -> bool:
    body = session.unseal(raw)
    if body is None:
        raise RuntimeError("verdict with a bad MAC")
    msg = wire.decode(body)
    assert isinstance(msg, wire.UpdateMsg) and msg.v and msg.v[0][0] == rid, msg
    return bool(Outcome.of(msg.v[0][1]) is Outcome.verified)


@dataclass
class _Prefill:
    """The prefill's pieces, set up before the pair's go: rows filled ahead and their digest
    frozen, the engine warmed up on the decode's scratch, the sockets connected, and what R0/R1
    send per slot (blocks, tags and rooms taken ahead)."""

    side: Side
    b: MetadataBuffers
    engine: MooncakeEngine  # the side's (the ladder runs on the engine route)
    spin: bool
    keys: Keys
    digest: RowDigest
    session: Session
    ctx: zmq.Context
    pair: zmq.Socket
    push: zmq.Socket
    ctl: zmq.Socket
    peer: dict[str, Any]  # the decode's info
    blocks: list[tuple[list[int], list[int], list[int]]]  # R0/R1: each slot's batch write
    tags: list[int]  # R0/R1: each slot's tag
    rooms: list[int]  # R0/R1: each slot's room, frozen
    orders_writes: bool  # the engine's writes follow the default stream's (no sync before them)
    workload: WorkloadSpec


def _prefill(rung: int, spec: PairSpec, run_dir: str, secret: bytes, conn: Connection,
             corrupt: Optional[int]) -> dict[str, Any]:
    """Set up, wait for the go, move spec.handoffs rows (after WARM untimed) rung `rung`'s way,
    say bye."""
    p = _prefill_setup(spec, run_dir, secret, conn)
    path = _send_path(spec, p) if rung >= 4 else None
    src = SlotAllocator(p.b.size)
    while conn.recv() != "go":
        pass
    n = spec.handoffs
    if path is None:
        hand, verified = _prefill_direct(rung, p, n, corrupt)
    else:
        hand, verified = _prefill_sent(rung, p, path, src, n, corrupt)
        path.sender.close(10)
    if rung >= 5:
        p.ctl.send(p.session.seal(wire.encode(wire.ByeMsg())))
    elif rung >= 1:
        p.push.send_multipart([BYE])
    else:
        p.pair.send(BYE)
    p.ctx.destroy(linger=5000)  # the bye out before the sockets close (the decode is waiting for it)
    b = p.b
    return {"handoff_us": hand, "verified": verified, "n": n, "transport": p.side.transport,
            "device": str(b.device), "row_bytes": b.row_bytes}


def _prefill_setup(spec: PairSpec, run_dir: str, secret: bytes, conn: Connection) -> _Prefill:
    side, b = _setup("prefill", spec, run_dir)
    backend = side.backend
    assert isinstance(backend, MooncakeBackend), "the ladder runs on the engine route"
    engine = backend.engine
    spin = spec.poll.spins(usable_cores())
    nonce = new_nonce()
    keys = Keys(secret, nonce)
    digest = RowDigest(b, keys, spec.digest)
    device_rows = b.device.type == "cuda"
    b.warm()
    digest.warm_seal(1)
    w = spec.workload
    pool = RequestPool(w, shapes(spec.side.buffers, b))
    for slot in range(b.size):  # fill=ahead as the run's SourceRows.fill_ahead
        b.set_buf(pool.get(slot, slot))
    b.sync()
    assert w.fill is FillMode.ahead, "the ladder fills ahead (its entry: orchestrator.bench)"
    digest.freeze()
    orders_writes = bool(device_rows and side.transport == "mooncake-nvlink_intra"
                         and torch.cuda.current_stream(b.device).cuda_stream == 0)
    conn.send(("info", {"nonce": nonce}))
    peer = conn.recv()
    session = Authenticator(secret).session(0, nonce, peer["nonce"], "prefill")
    ctx = zmq.Context()
    limit = wire.max_frame_bytes(b.item_lens, b.size)
    pair = _sock(ctx, zmq.PAIR, limit)
    pair.connect(peer["pair"])
    push = _sock(ctx, zmq.PUSH, limit)
    push.connect(peer["pull"])
    ctl = _sock(ctx, zmq.DEALER, limit)
    ctl.connect(peer["ctl"])
    src_ptrs, _, lens = b.get_buf_infos()
    blocks = [([p + k * s for p, k in zip(src_ptrs, lens)],
               [p + k * s for p, k in zip(peer["aux_ptrs"], lens)], list(lens)) for s in range(b.size)]
    engine.batch_write(peer["session_id"], [b.scratch_ptr], [peer["scratch_ptr"]], [WARM_BYTES])  # warm-up
    tags = digest.sign(list(range(b.size)), [(0, s) for s in range(b.size)])[0]  # R0/R1: per slot, ahead
    rooms = [b.room(s) for s in range(b.size)]
    return _Prefill(side, b, engine, spin, keys, digest, session, ctx, pair, push, ctl, peer, blocks, tags, rooms,
                    orders_writes, w)


@dataclass
class _SendPath:
    """R4+: the run's send path to the decode (the backend's AuxRouter behind a Link) and its
    Sender (the queue, and the transfer thread for steps that overlap)."""

    router: SendPath
    link: Link
    sender: Sender
    wake: zmq.Socket  # the transfer thread's wake-up socket's bound end (kept open while it runs)


def _send_path(spec: PairSpec, p: _Prefill) -> _SendPath:
    peer, t, plan = p.peer, spec.transport, spec.plan
    router = p.side.backend.router(p.push, p.session, 0)  # transport.mooncake.max_blocks_per_batch a batch
    router.connect(Peer(peer["session_id"], peer["aux_ptrs"], peer["item_lens"], peer["slots"],
                        scratch_ptr=peer["scratch_ptr"], auth=p.session))
    link = Link(0, 0, p.push, router, "decode")
    wake = _sock(p.ctx, zmq.PAIR, 64)
    wake_addr = f"inproc://ladder-wake-{id(wake)}"
    wake.bind(wake_addr)
    nap_s = t.mooncake.nap_us / 1e6 if plan.completion is CompletionSetting.nap else 0.0
    sender = Sender(p.ctx, wake_addr, lambda step: None, nap_s, t.max_inflight_sends, p.b.device, p.spin)
    sender.start()
    return _SendPath(router, link, sender, wake)


def _prefill_direct(rung: int, p: _Prefill, n: int, corrupt: Optional[int]) -> tuple[list[float], int]:
    """R0-R3, timed from row ready to verdict received: R0 the batch write and the raw status on
    the PAIR; R1 the status as authenticated frames; R2/R3 the seal per request first (the
    decode's side differs between R2 and R3)."""
    b, engine, spin, keys, digest, session = p.b, p.engine, p.spin, p.keys, p.digest, p.session
    pair, push, blocks, tags, frozen_rooms, w = p.pair, p.push, p.blocks, p.tags, p.rooms, p.workload
    dst_session, engine_orders_writes = p.peer["session_id"], p.orders_writes
    hand: list[float] = []
    verified = 0
    pc = time.perf_counter
    for i in range(n + WARM):
        rid = i + 1
        k = i % b.size
        room = room_of(w, rid) or 1
        flip = corrupt is not None and i == WARM + corrupt
        t0 = pc()
        if flip and rung <= 1:
            _flip(b, k)
        if rung == 0:
            engine.batch_write(dst_session, *blocks[k])
            pair.send(RAW_STATUS.pack(k, frozen_rooms[k], tags[k]))
            slot, ok = RAW_VERDICT.unpack(_recv(pair, spin))
            good = bool(ok) and slot == k
        elif rung == 1:
            engine.batch_write(dst_session, *blocks[k])
            push.send(session.sign_frame(wire.status_frame(0, [(rid, frozen_rooms[k], k, SUCCESS, tags[k])])))
            good = _verdict_ok(session, _recv(pair, spin), rid)
        else:
            pad = keys.pad(0, rid)
            sealed = digest.seal([k], [room], [pad], [(0, rid)], ahead=True)
            if not engine_orders_writes:
                b.sync()
            tag = sealed.result()[0][0]
            if flip:
                _flip(b, k)
            engine.batch_write(dst_session, *blocks[k])
            sealed.landed = True  # as the run's send path tells it (the seal's inputs are free)
            push.send(session.sign_frame(wire.status_frame(0, [(rid, room, k, SUCCESS, tag)])))
            good = _verdict_ok(session, _recv(pair, spin), rid)
        t1 = pc()
        if flip:
            _flip(b, k)  # restored: the slot's later handoffs carry its sealed bytes again
        if i >= WARM:
            hand.append((t1 - t0) * 1e6)
            verified += good
    return hand, verified


def _announce(p: _Prefill, src: SlotAllocator, rid: int, room: int) -> tuple[int, int]:
    """R5: request `rid` announced on the control channel, its grant taken: (its source slot,
    the decode slot granted). Before the row is ready: outside the timed span."""
    ctl, session = p.ctl, p.session
    ctl.send(session.seal(wire.encode(wire.ArriveMsg(reqs=[[rid, room]], contiguous=False))))
    body = session.unseal(_recv(ctl, p.spin))
    if body is None:
        raise RuntimeError("grant with a bad MAC")
    msg = wire.decode(body)
    assert isinstance(msg, wire.UpdateMsg) and msg.grants and msg.grants[0][0] == rid, msg
    got = src.alloc()
    assert got is not None, "one in flight: a source slot is always free"
    return got, msg.grants[0][1]


def _prefill_sent(rung: int, p: _Prefill, path: _SendPath, src: SlotAllocator, n: int,
                  corrupt: Optional[int]) -> tuple[list[float], int]:
    """R4+: the step handed to the Sender alone in flight and pumped (its write finished, its
    status out) before the verdict is waited for, as the run's loop does; R5 announces each
    request and takes its grant first (before the row is ready, outside the timed span, as in
    the run), and has the verdict on the control channel."""
    b, spin, keys, digest, session, ctl, pair = p.b, p.spin, p.keys, p.digest, p.session, p.ctl, p.pair
    w, engine_orders_writes, router, link, sender = p.workload, p.orders_writes, path.router, path.link, path.sender
    hand: list[float] = []
    verified = 0
    pc = time.perf_counter
    for i in range(n + WARM):
        rid = i + 1
        k = i % b.size
        dst = k
        room = room_of(w, rid) or 1
        if rung >= 5:  # announce, take the grant (before the row is ready, as in the run)
            k, dst = _announce(p, src, rid, room)
        flip = corrupt is not None and i == WARM + corrupt
        t0 = pc()
        pad = keys.pad(0, rid)
        sealed = digest.seal([k], [room], [pad], [(0, rid)], ahead=True)
        if not engine_orders_writes:
            b.sync()
        if flip:
            _flip(b, k)
        transfers = [Transfer(rid, room, k, dst)]
        step = ForwardStep([Req(rid, room, 0, 0.0, pad, dst, k)],
                           [(link, transfers, router.sends(transfers))], sealed=sealed)
        if sealed.ready:
            step.take_seal()
        sender.submit(step, alone=True)
        sender.pump()  # one in flight: the write lands, its status goes out
        if sender.error:
            raise RuntimeError(sender.error)
        assert sender.done and not sender.busy, "the step is finished before its verdict can come"
        sender.done.popleft()
        good = _verdict_ok(session, _recv(ctl if rung >= 5 else pair, spin), rid)
        if rung >= 5:
            src.free(k)
        t1 = pc()
        if flip:
            _flip(b, k)  # restored: the slot's later handoffs carry its sealed bytes again
        if i >= WARM:
            hand.append((t1 - t0) * 1e6)
            verified += good
    return hand, verified
