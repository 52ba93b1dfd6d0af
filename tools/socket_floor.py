"""The socket floor under the ladder's R1 rung (issue 39): what the authenticated frames' round
trip costs in ZMQ alone, against the 24-byte PAIR round trip of R0, with and without our code.

Two processes on this host, one in flight, both busy-polling (as the ladder on a GPU host):

  pair24         R0's sockets: a 24-byte status and a 16-byte verdict on one PAIR (ZMQ alone)
  sglang-frames  the status as it was before issue 39's one-frame status, for the record: 6
                 frames (SGLang's 4, our identity frame, a 16-byte MAC frame) on a PUSH -> PULL
                 socket, a verdict of the sealed UpdateMsg's length back on the PAIR; bytes
                 prepared ahead (ZMQ alone, none of our code)
  r1-frames      R1's sockets and frame shape: the same with the status as the run sends it
                 now, one 60-byte status frame (one entry, its MAC inside); bytes ahead
  r1-ours        r1-frames with our code per message, as R1 and the run: wire.status_frame +
                 Session.sign_frame, Session.open_frame + wire.parse, the verdict's
                 wire.encode + Session.seal, unseal + wire.decode
  push24         R0's 24-byte status on R1's PUSH -> PULL socket, the 16-byte verdict on the
                 PAIR: the second socket alone (ZMQ alone)
  one64          a 64-byte status in one frame on the PUSH -> PULL socket, the sealed verdict's
                 length back on the PAIR (ZMQ alone; r1-frames is the same with the real frame)
  r5-frames      r1-frames with the verdict on R5's (and the run's) control channel: ROUTER ->
                 DEALER, the prefill's identity frame in front of it (ZMQ alone)
  inproc-ours    r1-ours's code per round trip in ONE process, no socket: what our code costs
                 on this host's cores alone (r1-ours - r1-frames against it: the part that two
                 processes add to our code)

    python tools/socket_floor.py [N]      # N timed round trips a mode (default 5000), p50 us

r1-frames - pair24 is the sockets' own part of R1 (outside this project's code); r1-ours -
r1-frames is ours; sglang-frames - r1-frames what the one frame saved; push24 - pair24 the
second socket's part; r5-frames - r1-frames the control channel's part of R5 (the verdict
on ROUTER -> DEALER, not the PAIR)."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import struct
import sys
import time

import zmq

from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Session
from orchestrator.results.outcomes import Detail, KVPoll, Outcome

ITEM_LENS = [32, 32, 32, 64, 8, 64, 14336, 64, 128, 32]  # any layout: parse checks slot bounds
SLOTS = 64
WARM = 200


def _recv(sock: zmq.Socket, multipart: bool = False) -> object:
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK) if multipart else sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            continue


def _verdict(s: Session, rid: int) -> bytes:
    t = time.monotonic_ns()
    return s.seal(wire.encode(wire.UpdateMsg(grants=[], v=[[rid, Outcome.verified.code, Detail.none.code, t, t, t]])))


def _check_verdict(s: Session, frame: bytes) -> None:
    """The prefill's side of a verdict: unsealed, decoded, verified (as the run's drain)."""
    body = s.unseal(frame)
    assert body is not None
    m = wire.decode(body)
    assert isinstance(m, wire.UpdateMsg) and Outcome.of(m.v[0][1]) is Outcome.verified


def decode(mode: str, n: int, keys: tuple[bytes, bytes], addrs: "mp.Queue") -> None:
    ctx = zmq.Context()
    pair, pull, router = ctx.socket(zmq.PAIR), ctx.socket(zmq.PULL), ctx.socket(zmq.ROUTER)
    addrs.put((f"tcp://127.0.0.1:{pair.bind_to_random_port('tcp://127.0.0.1')}",
               f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}",
               f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"))
    ident = _recv(router, True)[0] if mode == "r5-frames" else b""  # the prefill's hello
    s = Session(keys[1], keys[0])
    canned = _verdict(Session(keys[1], keys[0]), 1)
    for _ in range(n + WARM):
        if mode == "pair24":
            _recv(pair)
            pair.send(b"v" * 16)
        elif mode == "push24":
            _recv(pull)
            pair.send(b"v" * 16)
        elif mode in ("sglang-frames", "r1-frames", "one64"):
            _recv(pull, True)
            pair.send(canned)
        elif mode == "r5-frames":
            _recv(pull, True)
            router.send_multipart([ident, canned])
        else:
            frames = _recv(pull, True)
            body = s.open_frame(frames[0]) if len(frames) == 1 else None
            assert body is not None
            st = wire.parse([body], ITEM_LENS, SLOTS)
            assert isinstance(st, wire.StepStatus)
            pair.send(_verdict(s, st.entries[0][0]))
    time.sleep(0.2)


def prefill(mode: str, n: int, keys: tuple[bytes, bytes], pair_at: str, pull_at: str, ctl_at: str) -> list[float]:
    ctx = zmq.Context()
    pair, push, dealer = ctx.socket(zmq.PAIR), ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    pair.connect(pair_at)
    push.connect(pull_at)
    dealer.connect(ctl_at)
    if mode == "r5-frames":
        dealer.send(b"hello")
    s = Session(keys[0], keys[1])
    success = int(KVPoll.Success)
    old = s.sign(wire.encode_status(1234, KVPoll.Success, 0) + [b"ORCH1" + struct.pack("<QIQ", 1, 3, 99)])
    canned = s.sign_frame(wire.status_frame(0, [(1, 1234, 3, success, 99)]))
    out = []
    pc = time.perf_counter
    for i in range(n + WARM):
        t0 = pc()
        if mode == "pair24":
            pair.send(b"s" * 24)
            _recv(pair)
        elif mode == "push24":
            push.send(b"s" * 24)
            _recv(pair)
        elif mode == "one64":
            push.send(b"s" * 64)
            _recv(pair)
        elif mode == "sglang-frames":
            push.send_multipart(old, copy=False)
            _recv(pair)
        elif mode == "r1-frames":
            push.send(canned)
            _recv(pair)
        elif mode == "r5-frames":
            push.send(canned)
            _recv(dealer)
        else:
            push.send(s.sign_frame(wire.status_frame(0, [(i + 1, 1234, 3, success, 99)])))
            _check_verdict(s, _recv(pair))
        if i >= WARM:
            out.append((pc() - t0) * 1e6)
    return out


def inproc(n: int, keys: tuple[bytes, bytes]) -> list[float]:
    """r1-ours's per-message code, both sides in this process, in the order a round trip runs it."""
    p, d = Session(keys[0], keys[1]), Session(keys[1], keys[0])
    success, out, pc = int(KVPoll.Success), [], time.perf_counter
    for i in range(n + WARM):
        t0 = pc()
        body = d.open_frame(p.sign_frame(wire.status_frame(0, [(i + 1, 1234, 3, success, 99)])))
        assert body is not None
        st = wire.parse([body], ITEM_LENS, SLOTS)
        assert isinstance(st, wire.StepStatus)
        _check_verdict(p, _verdict(d, st.entries[0][0]))
        if i >= WARM:
            out.append((pc() - t0) * 1e6)
    return out


def one(mode: str, n: int) -> float:
    keys = (os.urandom(32), os.urandom(32))
    if mode == "inproc-ours":
        return statistics.median(inproc(n, keys))
    q: mp.Queue = mp.Queue()
    p = mp.get_context("fork").Process(target=decode, args=(mode, n, keys, q))
    p.start()
    pair_at, pull_at, ctl_at = q.get()
    times = prefill(mode, n, keys, pair_at, pull_at, ctl_at)
    p.join()
    return statistics.median(times)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    rounds: dict[str, list[float]] = {m: [] for m in ("pair24", "push24", "one64", "sglang-frames", "r1-frames",
                                                      "r5-frames", "r1-ours", "inproc-ours")}
    for _ in range(3):  # interleaved rounds
        for m in rounds:
            rounds[m].append(one(m, n))
    print(f"socket round trip, one in flight, {n} a run, 3 interleaved runs: p50 us (median of runs) [runs]")
    for m, v in rounds.items():
        print(f"  {statistics.median(v):8.1f}  {m:13s} {[round(x, 1) for x in v]}")


if __name__ == "__main__":
    main()
