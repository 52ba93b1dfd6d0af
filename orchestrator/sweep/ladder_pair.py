"""The cost ladder's own prefill/decode pair (rungs R0-R5 of orchestrator.sweep.ladder).

One pair of processes (spawned, as the run's endpoints are) moves N rows one in flight with
this project's own pieces, each rung adding one component to the one below:

  R0  the yardstick's loop (../shared/tools/handoff_yardstick.py) from our pieces: our
      MooncakeEngine's batch write of the row (our MetadataBuffers, filled ahead, tags taken
      per slot before timing), a 24-byte status (slot, room, tag) over a ZMQ PAIR, the decode's
      check on the rows' device (RowDigest.read of the landed row against the status's tag),
      a 16-byte verdict back
  R1  + our authenticated frames: the status as SGLang's frames plus our identity frame, MAC'd
      with the pair's session keys (wire.encode_status, Session.sign) on a PUSH -> PULL data
      socket, parsed strictly (wire.parse); the verdict a sealed UpdateMsg (Session.seal)
  R2  + our seal: per request the room written and the keyed digest taken and its tag written
      (RowDigest.seal of rows filled ahead, as the run's loop does with workload.fill=ahead:
      SGLang's bootstrap_room[slot, 0] = room and kv_checksum, one indexed write; the keyed tag
      from the frozen sums), the decode checking room and tag of what landed and zeroing the
      previous slot's room in the same read
  R3  + the readiness gate as configured: the decode reads through endpoints.judge.Rows
      (gate.read, zero_room_on_free) and judges with endpoints.judge.Judge (gate.readiness,
      gate.settle_ms), a held row read again until the gate lets it through
  R4  + the transfer thread: the prefill's write and status go through endpoints.sender.Sender
      and our send path (AuxRouter: start, finish, after_send), as the run's loop hands a step over
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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

import structlog
import torch
import zmq

from orchestrator.handoff.buffers import WARM_BYTES, MetadataBuffers, SlotAllocator
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.endpoints.common import SWITCH_INTERVAL_S, build_side, process_gpu, shapes
from orchestrator.handoff.endpoints.decode_state import Grant
from orchestrator.handoff.endpoints.judge import Judge, Rows
from orchestrator.handoff.endpoints.links import Link, Req
from orchestrator.handoff.endpoints.sender import ForwardStep, Sender
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, Session, new_nonce
from orchestrator.handoff.transport.router import AuxRouter, Peer, Transfer
from orchestrator.handoff.workload import RequestPool, room_of
from orchestrator.profile.config import CompletionSetting, FillMode, OrchestratorConfig
from orchestrator.profile.plan import Plan
from orchestrator.profile.platform import usable_cores
from orchestrator.results.logs import configure
from orchestrator.results.outcomes import Detail, KVPoll, Outcome
from orchestrator.results.records import DecodeResult

RAW_STATUS = struct.Struct("<qqq")  # R0: slot, room, tag
RAW_VERDICT = struct.Struct("<qq")  # R0: slot, ok
BYE = b"bye"
WARM = 50  # untimed handoffs first, as the yardstick's


def _sock(ctx: zmq.Context, kind: int, max_bytes: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    return s


def _setup(role: str, cfg: OrchestratorConfig, plan: Plan, run_dir: str) -> tuple[Any, MetadataBuffers]:
    torch.set_num_threads(1)  # as the endpoints (common.start_process)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log = configure(Path(run_dir), role)
    side = build_side(cfg.buffers, cfg.layout, cfg.transport, plan, role, Path(run_dir), log,
                      process_gpu(plan, role, 0))
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
def decode_main(rung: int, cfg: OrchestratorConfig, plan: Plan, run_dir: str, secret: bytes,
                conn: Connection) -> None:
    try:
        res = _decode(rung, cfg, plan, run_dir, secret, conn)
        _log().info("ladder_decode_end", reason="bye", **res)
        conn.send(("result", res))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        _send_error("decode", conn, exc)


def _decode(rung: int, cfg: OrchestratorConfig, plan: Plan, run_dir: str, secret: bytes,
            conn: Connection) -> dict[str, Any]:
    side, b = _setup("decode", cfg, plan, run_dir)
    spin = cfg.endpoints.poll.spins(usable_cores())
    ctx = zmq.Context()
    host = cfg.transport.host
    limit = wire.max_frame_bytes(b.item_lens, b.size)
    pair = _sock(ctx, zmq.PAIR, limit)
    pull = _sock(ctx, zmq.PULL, limit)
    ctl = _sock(ctx, zmq.ROUTER, limit)
    addrs = {name: f"tcp://{host}:{s.bind_to_random_port(f'tcp://{host}')}"
             for name, s in (("pair", pair), ("pull", pull), ("ctl", ctl))}
    nonce = new_nonce()
    ptrs, _, lens = b.get_buf_infos()
    engine = side.engine
    conn.send(("info", {"session_id": engine.session_id if engine else None, "aux_ptrs": ptrs,
                        "item_lens": lens, "slots": b.size, "scratch_ptr": b.scratch_ptr,
                        "nonce": nonce, **addrs}))
    peer = conn.recv()
    keys = Keys(secret, peer["nonce"])
    digest = RowDigest(b, keys, cfg.verify.digest)
    b.warm()
    digest.warm()
    session = Authenticator(secret).session(0, peer["nonce"], nonce, "decode")
    slots = SlotAllocator(b.size)
    rows = Rows(b, digest, slots, cfg.gate.read, cfg.gate.zero_room_on_free, True)
    res = DecodeResult("decode")
    judge = Judge(cfg.gate, cfg.transport.timeout_s, b, digest, res)
    pads = [keys.pad(0, s) for s in range(b.size)]  # R0/R1: tags taken per slot
    grants: dict[tuple[int, int], Grant] = {}
    verified = bad = held = 0
    last: Optional[int] = None  # R2: the previous slot, its room zeroed with this read
    ident: Optional[bytes] = None  # R5: the prefill's ROUTER identity
    poller = zmq.Poller()
    poller.register(ctl, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    conn.send(("ready", None))
    while True:
        if rung >= 5:  # the control channel first: an arrival to grant, or the end
            if not spin:
                poller.poll(1000)
            while True:
                try:
                    ident, raw = ctl.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                body = session.unseal(raw)
                if body is None:
                    raise RuntimeError("control message with a bad MAC")
                msg = wire.decode(body)
                if isinstance(msg, wire.ByeMsg):
                    return {"verified": verified, "bad": bad, "held": held}
                assert isinstance(msg, wire.ArriveMsg)
                out = []
                for rid, room in msg.reqs:
                    slot = slots.alloc()
                    assert slot is not None, "one in flight: a slot is always free"
                    grants[(0, rid)] = Grant(0, rid, room, slot, keys.pad(0, rid), time.monotonic())
                    out.append([rid, slot])
                ctl.send_multipart([ident, session.seal(wire.encode(wire.UpdateMsg(grants=out, v=[])))])
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
        elif rung == 0:
            m = _recv(pair, spin)
            if m == BYE:
                return {"verified": verified, "bad": bad, "held": held}
            slot, room, tag = RAW_STATUS.unpack(m)
            r = digest.read([slot], [(0, slot)])[0]
            ok = digest.expected_tag(r, pads[slot]) == tag
            verified += ok
            bad += not ok
            pair.send(RAW_VERDICT.pack(slot, ok))
            continue
        else:
            frames = _recv(pull, spin, multipart=True)
            if frames == [BYE]:
                return {"verified": verified, "bad": bad, "held": held}
        t_status = time.monotonic()
        body_frames = session.open(frames)
        if body_frames is None:
            raise RuntimeError("status with a bad MAC")
        st = wire.parse(body_frames, b.item_lens, b.size)
        assert isinstance(st, wire.Status) and st.rid is not None and st.slot is not None
        if rung == 1:
            r = digest.read([st.slot], [(0, st.slot)])[0]
            ok = digest.expected_tag(r, pads[st.slot]) == st.tag
            outcome = Outcome.verified if ok else Outcome.corrupted
            detail = Detail.none if ok else Detail.checksum_mismatch
        elif rung == 2:
            clear = [last] if last is not None and last != st.slot and cfg.gate.zero_room_on_free else []
            r = digest.read([st.slot], [(0, st.rid)], clear=clear)[0]
            last = st.slot
            g = Grant(0, st.rid, st.room, st.slot, keys.pad(0, st.rid), t_status, int(KVPoll.Success),
                      tag=st.tag, t_status=t_status)
            outcome, detail = judge.judge(g, r)
        else:  # R3+: the readiness gate as configured, through Rows and Judge
            if rung >= 5:
                g = grants.pop((0, st.rid))
                if g.slot != st.slot or g.room != st.room:
                    raise RuntimeError(f"status for request {st.rid} names slot {st.slot}, granted {g.slot}")
                g.status, g.tag, g.t_status = int(KVPoll.Success), st.tag, t_status
            else:
                slots.take(st.slot)
                g = Grant(0, st.rid, st.room, st.slot, keys.pad(0, st.rid), t_status, int(KVPoll.Success),
                          tag=st.tag, t_status=t_status)
            while True:
                checks, _, _, _ = rows.read_pass([g], time.perf_counter())
                now = time.monotonic()
                polled = judge.poll(g, checks[0], now)
                if polled != KVPoll.Transferring:
                    break
                held += 1
            v = judge.verdict(g, checks[0], polled, now)
            assert v is not None, "Success or Failed has a verdict"
            outcome, detail = v
            rows.free(g.slot)
            rows.zero_freed()
        ok = outcome is Outcome.verified
        verified += ok
        bad += not ok
        t_ns = time.monotonic_ns()
        update = wire.encode(wire.UpdateMsg(grants=[], v=[[st.rid, outcome.code, detail.code, t_ns,
                                                           int(t_status * 1e9), t_ns]]))
        if rung >= 5:
            assert ident is not None
            ctl.send_multipart([ident, session.seal(update)])
        else:
            pair.send(session.seal(update))


# ---- prefill -------------------------------------------------------------------------------
def prefill_main(rung: int, cfg: OrchestratorConfig, plan: Plan, run_dir: str, secret: bytes, n: int,
                 conn: Connection, corrupt: Optional[int] = None, hold_for: Optional[int] = None) -> None:
    """`corrupt` (tests): the timed handoff of this index has one byte of its source row changed
    after its seal and before its write (restored after its verdict): the decode must not
    verify it. `hold_for` (tests): the decode's pid; the result is sent only once that process
    is gone (ended and reaped by the parent), the order in which the parent must still take
    it."""
    try:
        res = _prefill(rung, cfg, plan, run_dir, secret, n, conn, corrupt)
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


def _prefill(rung: int, cfg: OrchestratorConfig, plan: Plan, run_dir: str, secret: bytes, n: int,
             conn: Connection, corrupt: Optional[int]) -> dict[str, Any]:
    side, b = _setup("prefill", cfg, plan, run_dir)
    engine = side.engine
    assert engine is not None, "the ladder runs on the engine route"
    spin = cfg.endpoints.poll.spins(usable_cores())
    nonce = new_nonce()
    keys = Keys(secret, nonce)
    digest = RowDigest(b, keys, cfg.verify.digest)
    device_rows = b.device.type == "cuda"
    b.warm()
    digest.warm_seal(1)
    w = cfg.workload
    pool = RequestPool(w, shapes(cfg.buffers, b))
    for slot in range(b.size):  # fill=ahead as the run's SourceRows.fill_ahead
        b.set_buf(pool.get(slot, slot))
    b.sync()
    assert w.fill is FillMode.ahead, "the ladder fills ahead (ladder.ladder_config)"
    digest.freeze()
    engine_orders_writes = bool(device_rows and side.transport == "mooncake-nvlink_intra"
                                and torch.cuda.current_stream(b.device).cuda_stream == 0)
    conn.send(("info", {"nonce": nonce}))
    peer_info = conn.recv()
    session = Authenticator(secret).session(0, nonce, peer_info["nonce"], "prefill")
    ctx = zmq.Context()
    limit = wire.max_frame_bytes(b.item_lens, b.size)
    pair = _sock(ctx, zmq.PAIR, limit)
    pair.connect(peer_info["pair"])
    push = _sock(ctx, zmq.PUSH, limit)
    push.connect(peer_info["pull"])
    ctl = _sock(ctx, zmq.DEALER, limit)
    ctl.connect(peer_info["ctl"])
    dst_session = peer_info["session_id"]
    src_ptrs, _, lens = b.get_buf_infos()
    blocks = [([p + k * s for p, k in zip(src_ptrs, lens)],
               [p + k * s for p, k in zip(peer_info["aux_ptrs"], lens)], list(lens)) for s in range(b.size)]
    engine.batch_write(dst_session, [b.scratch_ptr], [peer_info["scratch_ptr"]], [WARM_BYTES])  # warm-up
    tags = digest.sign(list(range(b.size)), [(0, s) for s in range(b.size)])[0]  # R0/R1: per slot, ahead
    frozen_rooms = [b.room(s) for s in range(b.size)]
    router: Optional[AuxRouter] = None
    sender: Optional[Sender] = None
    link: Optional[Link] = None
    if rung >= 4:
        router = AuxRouter(plan, b, session, 0, engine, push,
                           max_blocks_per_batch=cfg.transport.mooncake.max_blocks_per_batch)
        router.connect(Peer(dst_session, peer_info["aux_ptrs"], peer_info["item_lens"], peer_info["slots"],
                            scratch_ptr=peer_info["scratch_ptr"], auth=session))
        link = Link(0, 0, push, router, "decode")
        wake = _sock(ctx, zmq.PAIR, 64)
        wake_addr = f"inproc://ladder-wake-{id(wake)}"
        wake.bind(wake_addr)
        nap_s = cfg.transport.mooncake.nap_us / 1e6 if plan.completion is CompletionSetting.nap else 0.0
        sender = Sender(ctx, wake_addr, lambda step: None, nap_s, cfg.transport.max_inflight_sends,
                        b.device, spin)
        sender.start()
    src = SlotAllocator(b.size)
    while conn.recv() != "go":
        pass
    hand: list[float] = []
    verified = 0
    pc = time.perf_counter
    for i in range(n + WARM):
        rid = i + 1
        k = i % b.size
        dst = k
        room = room_of(w, rid) or 1
        if rung >= 5:  # announce, take the grant (before the row is ready, as in the run)
            ctl.send(session.seal(wire.encode(wire.ArriveMsg(reqs=[[rid, room]], contiguous=False))))
            body = session.unseal(_recv(ctl, spin))
            if body is None:
                raise RuntimeError("grant with a bad MAC")
            msg = wire.decode(body)
            assert isinstance(msg, wire.UpdateMsg) and msg.grants and msg.grants[0][0] == rid, msg
            dst = msg.grants[0][1]
            got = src.alloc()
            assert got is not None, "one in flight: a source slot is always free"
            k = got
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
            push.send_multipart(session.sign(wire.encode_status(frozen_rooms[k], KVPoll.Success, 0, rid, k,
                                                                tags[k])), copy=False)
            good = _verdict_ok(session, _recv(pair, spin), rid)
        elif rung <= 3:
            pad = keys.pad(0, rid)
            sealed = digest.seal([k], [room], [pad], [(0, rid)], ahead=True)
            if not engine_orders_writes:
                b.sync()
            tag = sealed.result()[0][0]
            if flip:
                _flip(b, k)
            engine.batch_write(dst_session, *blocks[k])
            push.send_multipart(session.sign(wire.encode_status(room, KVPoll.Success, 0, rid, k, tag)), copy=False)
            good = _verdict_ok(session, _recv(pair, spin), rid)
        else:  # R4+: the step handed to the transfer thread, as the run's loop does
            assert router is not None and sender is not None and link is not None
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
            if step.sealed is None and router.starts_in_caller:
                for send in step.work[0][2]:
                    router.start(send)
                step.started = True
            sender.submit(step)
            good = _verdict_ok(session, _recv(ctl if rung >= 5 else pair, spin), rid)
            while not sender.done:  # the step is finished before its verdict can come
                if sender.error:
                    raise RuntimeError(sender.error)
                time.sleep(0)
            sender.done.popleft()
            if rung >= 5:
                src.free(k)
        t1 = pc()
        if flip:
            _flip(b, k)  # restored: the slot's later handoffs carry its sealed bytes again
        if i >= WARM:
            hand.append((t1 - t0) * 1e6)
            verified += good
    if sender is not None:
        sender.submit(None)
        sender.join(10)
    if rung >= 5:
        ctl.send(session.seal(wire.encode(wire.ByeMsg())))
    elif rung >= 1:
        push.send_multipart([BYE])
    else:
        pair.send(BYE)
    ctx.destroy(linger=5000)  # the bye out before the sockets close (the decode is waiting for it)
    return {"handoff_us": hand, "verified": verified, "n": n, "transport": side.transport,
            "device": str(b.device), "row_bytes": b.row_bytes}
