"""The route floor under issue 39's route goals: each aux route's transport timed alone, none of
this project's code, on one DeepSeek-V3 MTP aux row (10 field-major fields, 15,872 B a slot,
256 slots, as ../shared/tools/handoff_yardstick.py). Two processes a run (prefill, decode),
fresh for every run; the decode busy-polls its socket on `gpu` and blocks on `cpu`, the prefill
blocks for replies (as the yardstick).

  engine-1        one in flight: Mooncake's batch_transfer_sync_write of the slot's 10 blocks,
                  then a 24-byte status on a ZMQ PAIR, a 16-byte reply (no digest, no room
                  write); also the write alone
  engine-1+gate   engine-1 with the device touches SGLang 0.5.23's NVLink rows add to every
                  handoff, nothing else: the prefill's set_buf writes the request's bootstrap_room
                  into the row on the device (`bootstrap_room[slot, 0] = room`, one scalar write)
                  before the batch write; the decode's readiness gate reads it back
                  (`_apply_metadata_gate`: `.item()`, one device sync), compares it with the
                  status's room, and zeroes it when the slot is freed (clear_slot's scalar write)
  tcp-1           one in flight, SGLang 0.5.23's tcp route wire (host rows): 10 PUSHed
                  [b"AUX_DATA", room, field, slot, >I n, payload] messages (payloads are
                  memoryview slices of the prefill's rows; field, slot and length frames built
                  ahead), then the status [room, b"4", b"0"] on the same socket; the decode
                  parses each, memmoves the payload into its rows at the slot, and replies
                  16 bytes on the PAIR to the status. Timed: first AUX_DATA send -> reply
  tcp-1+gate      tcp-1 with the same room written, read and zeroed (host rows: numpy scalars)
  engine-sync     requests/s, W=1: sync batch writes back to back (no status)
  engine-pipe     requests/s, W requests in flight: batch_transfer_async_write per request
                  (its 10 blocks), the oldest waited for with get_batch_transfer_status (a
                  sliding window); writes only, no status: the engine's ceiling
  engine-pipe+st  engine-pipe plus a 24-byte status PUSHed per landed write and a 16-byte
                  reply per status on the PAIR, at most W unanswered (tcp-pipe's control path)
  tcp-pipe        requests/s: tcp-1's messages with at most W requests unanswered
  engine-co64     handoffs (requests)/s, coalesced: steps of 64 requests in consecutive slots
                  (0-255 in runs of 64), W / 64 steps unanswered (W 64-256). Per step the 64
                  rooms (request i's is i + 1) written into the rows in one op (a slice assignment
                  from a prebuilt array of rooms; gpu: a device tensor, then a stream sync so the
                  rooms are in before the write), one batch_transfer_async_write of 10 blocks (a
                  field's 64 slots each) and, once landed (the loop waits on its oldest write when
                  no reply is waiting), a 24-byte status (first slot, first room, 64); the decode
                  gates the step as SGLang gates a request, batched: the 64 rooms read in one copy
                  (gpu: the zero queued behind it, one sync), compared with the status's, zeroed,
                  and a 16-byte reply that frees the step's slots

On SGLang 0.5.23's default aux rows instead (conf/buffers/default.yaml: its own MetadataBuffers,
compiled from the installed wheel as tests/helpers/sglang_oracle.py does, 64 slots, 10 fields,
1,600 B a slot, each field registered with the engine as SGLang does), the default run's shape
(conf/workload/default.yaml, conf/transport/default.yaml) with none of this project's code:
  engine-raw      requests/s: engine-sync on these rows (the bench's "raw": Mooncake's
                  batch_transfer_sync_write of one request's 10 blocks, back to back)
  engine-inline   requests/s, a closed loop of 8 in flight (the default concurrency): per
                  request SGLang's own set_buf into a free slot (a request object with the
                  default workload's fields: first token, logprob and top 5, hidden states and
                  a top-16 draft), one batch_transfer_async_write of the row's 10 blocks, and
                  once it has landed (get_batch_transfer_status) a 24-byte status PUSHed; the
                  decode compares every byte of the landed row with what set_buf writes for
                  that request (its rows computed at start-up from the same requests, the room
                  from the request id) and replies a 16-byte verdict on the PAIR; a verdict
                  frees the slot and starts the next request. The loop itself waits on its
                  oldest write, only when no verdict is waiting and the window is full
  engine-inline+thr  the same, a second thread waiting on each write in turn and sending its
                  status (the loop blocks on verdicts)
Per rate mode, the CPU of each process (every thread: /proc/PID/task/*/schedstat) over the
timed pass, in us a request, and the box's other work over it (/proc/stat's busy time less both
processes' CPU): a run with 0.1 cores or more of it is not quiet, and a floor line then adds its
ratio of medians over the quiet rounds. On cpu the driver waits before each run (at most 60 s)
for the box's work to fall under 0.1 cores; the box is shared, so a run may still not be quiet.

    python tools/route_floor.py cpu|gpu [N] [ROUNDS] [W] [MODES]
        # N requests a run (default 3000; engine-co64: rounded up to whole steps), ROUNDS
        # interleaved (3), window W (256; with engine-co64 64, 128, 192 or 256), MODES a comma
        # list (default: all; the default-row modes on cpu only; engine-co64 only where W is one
        # of those)

cpu: every row in host memory, the engine with MC_FORCE_TCP=1 and its TCP lane queue raised to
10 W blocks a peer (MC_TCP_MAX_{QUEUED_TRANSFERS,PENDING_ADMISSIONS}_PER_PEER: past 1024 + 1024
blocks in flight, the defaults, it fails writes, "TCP lane queue-full"). gpu: the engine's rows
on cuda:0 (prefill) and cuda:$IDEAL_GPU_D (decode, default 0), MC_INTRANODE_NVLINK=1 and
MC_FORCE_TCP unset; the tcp route stays on host rows (as the bench's tcp route, mem_pool=host).
Mooncake's per-batch INFO line is silenced after start-up (glog's minloglevel). Run it under the
MPS daemon where the ladder runs under one. Needs numpy, pyzmq and the Mooncake wheel (torch on
gpu). At the end of every run the decode's rows must equal the prefill's (every slot written;
the gate modes: but for the rooms the decode zeroed).

The floors: tcp-1 / engine-1 against "tcp route / NVLink one in flight >= 2x" (G1; G1g: the
same with SGLang's room written, gated and zeroed on both routes, what a handoff on either
route cannot skip), and engine-pipe / tcp-pipe against "per-request NVLink / tcp route >= 3x" (G2); engine-sync /
tcp-pipe is G2 with the engine's W=1 (one H200, NVLink: sync writes ran as fast as a window of
8-256, the transport waiting on the CPU before each submit), and engine-pipe+st / tcp-pipe G2
with the same control messages on both routes; engine-inline / engine-raw (and the +thr form)
against "2-core CPU box: the default run >= 0.8x raw" (G5: the transport with SGLang's set_buf,
a status and a checked verdict); engine-co64 against "NVLink coalesced b64 >= 100,000 handoffs/s"
and engine-co64 / engine-pipe+st against ">= 20x per-request" (the 2-core box's: >= 10x), the
coalesced goal's floor. Where a floor is below its goal, the goal's floor lies outside
this project's code. The tcp route here is leaner than SGLang's own: SGLang 0.5.23 copies each
row into bytes before the send and writes the payload with a ctypes slice assignment on
receipt."""

from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import os
import queue
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types

import numpy as np
import zmq
from cpu_floor import box, threads, wait_quiet  # (tools/: /proc readers; it imports nothing of orchestrator at load)

AUX = [64, 64, 64, 64, 512, 512, 64, 128, 14336, 64]  # DeepSeek-V3 MTP aux row, bytes a field
NSLOTS = 256
WARM = 200  # untimed requests before each timed pass
WAIT_S = 60.0  # the longest any process waits for its peer
QUIET = 0.1  # a rate run is quiet while the box's other work stays under this many cores
QUIET_WAIT_S = 60.0  # cpu: the longest the driver waits, before a run, for the box to fall quiet
# SGLang 0.5.23's default aux row (conf/buffers/default.yaml), bytes a field, bootstrap_room last
DEFAULT_AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 64]
DEFAULT_SLOTS = 64
INFLIGHT = 8  # conf/workload/default.yaml: concurrency, a closed loop
POOL = 256  # distinct requests; request i fills its row from request i % POOL
ONE = ("engine-1", "engine-1+gate", "tcp-1", "tcp-1+gate")
RATE = ("engine-sync", "engine-pipe", "engine-pipe+st", "tcp-pipe", "engine-co64")
GATED = ("engine-1+gate", "tcp-1+gate", "engine-co64")  # the decode zeroes the rooms it gated
CO = 64  # engine-co64: requests a step, in consecutive slots
CO_GOAL = 100_000  # handoffs/s: issue 39's NVLink coalesced b64 goal
INLINE = ("engine-inline", "engine-inline+thr")
DEFAULT_ROW = ("engine-raw",) + INLINE  # the modes on SGLang's default rows, cpu's by default
ST = struct.Struct("<qqq")  # 24-byte status: slot, room (engine-inline: the request id), 0 (engine-co64: a step's
# first slot and room, its requests)
REPLY = struct.Struct("<qq")  # 16-byte reply: slot or room, 1 or the status (engine-inline: 1 if the row is right)
ROOM_ROW = struct.Struct("<Q56x")  # a bootstrap_room row as set_buf leaves it: the room, then zeros
AUX_DATA = b"AUX_DATA"
_TRANSPORTS = ((re.compile(r"Intra-Node NVLink transport|IntraNodeNvlinkTransport", re.I), "nvlink-intra"),
               (re.compile(r"RdmaTransport|using RDMA|rdma_transport", re.I), "rdma"),
               (re.compile(r"TcpTransport|using TCP transport", re.I), "tcp"))


# ---- the two processes -------------------------------------------------------------------
def _layout(mode: str) -> tuple[list[int], int]:
    """The mode's row: bytes a field, and slots."""
    return (DEFAULT_AUX, DEFAULT_SLOTS) if mode in DEFAULT_ROW else (AUX, NSLOTS)


def _sglang_buffers(slots: int):
    """SGLang 0.5.23's own MetadataBuffers, compiled from the installed wheel
    (tests/helpers/sglang_oracle.py), in conf/buffers/default.yaml's shape: hidden 16 float32,
    256 sampling-mask tokens (off), top logprobs 128, no DSA indices, no kv_checksum."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.helpers.sglang_oracle import load

    bufs = load().MetadataBuffers(slots, 16, torch.float32, 256, 128, None, 0, kv_checksum_enabled=False)
    ptrs, _, lens = bufs.get_buf_infos()
    if lens != DEFAULT_AUX or ptrs[-1] != bufs.bootstrap_room.data_ptr():
        raise SystemExit(f"route_floor: SGLang's default aux row is {lens}, not {DEFAULT_AUX}")
    return bufs


def _buffer_rows(bufs) -> tuple[list[np.ndarray], list[int]]:
    """The MetadataBuffers' fields as flat uint8 arrays over their memory, and their addresses."""
    ptrs, sizes, _ = bufs.get_buf_infos()
    return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p)) for p, n in zip(ptrs, sizes)], ptrs


class _Req:
    """What SGLang 0.5.23's set_buf reads of a Req, as the default workload's requests have it
    (conf/workload/default.yaml): a first token with its logprob and top 5, hidden states with a
    top-16 draft; no sampling mask, no multimodal tokens (no DSA field on the default rows)."""

    return_logprob = True
    return_sampling_mask = False
    cached_tokens_storage = 0
    output_dsa_topk_indices = None

    def __init__(self, index: int) -> None:
        import torch

        rng = np.random.default_rng(7_000_003 + index)
        self.metadata_buffer_index, self.bootstrap_room = -1, 0
        self.output_ids = [int(rng.integers(0, 152_000))]
        prompt = int(rng.integers(16, 8192))
        self.cached_tokens = int(rng.integers(0, prompt))
        self.cached_tokens_device = int(rng.integers(0, self.cached_tokens + 1))
        self.cached_tokens_host = self.cached_tokens - self.cached_tokens_device
        top = sorted((-rng.random(5) * 10).tolist(), reverse=True)
        self.logprob = types.SimpleNamespace(
            output_token_logprobs_val=[top[0]], output_token_logprobs_idx=[self.output_ids[0]],
            output_top_logprobs_val=[top], output_top_logprobs_idx=[rng.integers(0, 152_000, 5).tolist()])
        self.hidden_states_tensor = torch.from_numpy(rng.standard_normal(16, dtype=np.float32))
        self.output_topk_p = torch.softmax(torch.from_numpy(rng.standard_normal(16, dtype=np.float32)), 0)
        self.output_topk_index = torch.from_numpy(rng.integers(0, 152_000, 16, dtype=np.int64))

    def get_mm_token_counts(self) -> tuple[int, int, int]:
        return 0, 0, 0


def _room(rid: int) -> int:
    """Request `rid`'s bootstrap room: nonzero, 63 bits."""
    return ((rid + 1) * 0x9E3779B97F4A7C15) & ((1 << 63) - 1) or 1


def _expected(pool: list[_Req]) -> list[bytes]:
    """Per request of the pool, its row as set_buf writes it into a fresh slot, less the room
    (the last field): SGLang's set_buf run on a MetadataBuffers of the pool's size."""
    bufs = _sglang_buffers(len(pool))
    for e, req in enumerate(pool):
        req.metadata_buffer_index, req.bootstrap_room = e, 0
        bufs.set_buf(req)
    rows, _ = _buffer_rows(bufs)
    return [b"".join(r[e * n:(e + 1) * n] for r, n in zip(rows[:-1], DEFAULT_AUX)) for e in range(len(pool))]


def _cpu_s(pid: int) -> float:
    """CPU seconds every live thread of `pid` has run so far (schedstat)."""
    return sum(t.run_ns for t in threads(pid, split=False).values()) / 1e9


def _rows(mode: str, where: str, fill: bool) -> tuple[list, list[int], object]:
    """The mode's field-major row buffers (random on the prefill, zeros on the decode) and
    their addresses: numpy on the host, torch on a CUDA device; on the default rows SGLang's
    MetadataBuffers (the third value; else None), random only for engine-raw's prefill (set_buf
    writes part of a row: the rest stays zero, as in SGLang)."""
    if mode in DEFAULT_ROW:
        bufs = _sglang_buffers(DEFAULT_SLOTS)
        rows, ptrs = _buffer_rows(bufs)
        if fill and mode not in INLINE:
            rng = np.random.default_rng(7)
            for r in rows:
                r[:] = rng.integers(0, 256, len(r), dtype=np.uint8)
        return rows, ptrs, bufs
    if where == "host":
        rng = np.random.default_rng(7)
        rows = [rng.integers(0, 256, NSLOTS * n, dtype=np.uint8) if fill else np.zeros(NSLOTS * n, np.uint8)
                for n in AUX]
        return rows, [r.ctypes.data for r in rows], None
    import torch

    torch.cuda.set_device(torch.device(where))
    g = torch.Generator().manual_seed(7)
    trows = [torch.randint(0, 256, (NSLOTS * n,), generator=g, dtype=torch.uint8).to(where) if fill
             else torch.zeros(NSLOTS * n, dtype=torch.uint8, device=where) for n in AUX]
    torch.cuda.synchronize()
    return trows, [t.data_ptr() for t in trows], None


def _digest(rows: list, gate: bool = False) -> str:
    """The rows' hash; with `gate`, the bootstrap_room words left out (the decode zeroes them)."""
    h = hashlib.blake2b(digest_size=16)
    for f, r in enumerate(rows):
        a = r.cpu().numpy() if hasattr(r, "cpu") else r
        h.update((a.reshape(NSLOTS, AUX[f])[:, 8:] if gate and f == len(AUX) - 1 else a).tobytes())
    return h.hexdigest()


def _rooms(rows: list):
    """bootstrap_room per slot: the first 8 bytes of the last field's row (as the yardstick)."""
    last = rows[-1]
    if not isinstance(last, np.ndarray):  # torch, on a CUDA device
        import torch

        return last.view(NSLOTS, AUX[-1])[:, :8].view(torch.int64)[:, 0]
    return last.reshape(NSLOTS, AUX[-1])[:, :8].view(np.int64)[:, 0]


def _quiet_glog() -> bool:
    """glog's minloglevel to WARNING in this process (Mooncake logs an INFO line per batch)."""
    with open("/proc/self/maps") as fh:
        paths = sorted({line.split()[-1] for line in fh if "/libglog" in line})
    for path in paths:
        try:
            ctypes.c_int.in_dll(ctypes.CDLL(path), "_ZN3fLI17FLAGS_minloglevelE").value = 1
            return True
        except (OSError, ValueError):
            continue
    return False


def _engine(ptrs: list[int], mode: str):
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("route_floor: Mooncake initialize failed")
    lens, slots = _layout(mode)
    for p, n in zip(ptrs, lens):
        if te.register_memory(p, slots * n) != 0:
            raise SystemExit("route_floor: Mooncake register_memory failed")
    return te


def _where(mode: str, dev: str, side: str) -> str:
    if mode.startswith("tcp") or mode in DEFAULT_ROW or dev == "cpu":
        return "host"
    return "cuda:0" if side == "prefill" else f"cuda:{os.environ.get('IDEAL_GPU_D', '0')}"


def _recv_fn(sock: zmq.Socket, spin: bool, multipart: bool, limit_s: float = WAIT_S):
    """A receive that gives up after `limit_s`: busy-polling with NOBLOCK, or blocking."""
    f = sock.recv_multipart if multipart else sock.recv
    if not spin:
        sock.setsockopt(zmq.RCVTIMEO, int(limit_s * 1000))
        return f

    def recv():
        k = 0
        end = 0.0
        while True:
            try:
                return f(zmq.NOBLOCK)
            except zmq.Again:
                k += 1
                if k & 0xFFFF == 0:
                    end = end or time.monotonic() + limit_s
                    if time.monotonic() > end:
                        raise SystemExit("route_floor: decode waited too long") from None

    return recv


def _limit_s(n: int) -> float:
    """The longest one run may take (the driver kills both processes after it)."""
    return 3 * WAIT_S + n / 100


def decode(mode: str, dev: str, rdv: str, n: int) -> None:
    rows, ptrs, _bufs = _rows(mode, _where(mode, dev, "decode"), False)  # _bufs: the rows' memory
    te = _engine(ptrs, mode) if mode.startswith("engine") else None
    quiet = _quiet_glog() if te else True
    expected = _expected([_Req(e) for e in range(POOL)]) if mode in INLINE else []
    ctx = zmq.Context()
    pair, pull = ctx.socket(zmq.PAIR), ctx.socket(zmq.PULL)
    pair.setsockopt(zmq.SNDHWM, 0)  # replies never wait on a high-water mark, whatever W
    info = dict(session=f"127.0.0.1:{te.get_rpc_port()}" if te else "", ptrs=ptrs, quiet=quiet, pid=os.getpid(),
                pair=f"tcp://127.0.0.1:{pair.bind_to_random_port('tcp://127.0.0.1')}",
                pull=f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    with open(rdv + ".tmp", "w") as fh:
        json.dump(info, fh)
    os.rename(rdv + ".tmp", rdv)
    spin = dev == "gpu"
    if mode in ("engine-sync", "engine-pipe", "engine-raw"):  # nothing to answer: the writes need no decode
        _recv_fn(pair, False, False, _limit_s(n))()
    elif mode in INLINE:  # every byte of the landed row against set_buf's, a verdict back
        recv = _recv_fn(pull, spin, False)
        at = [[memoryview(r)[k * ln:(k + 1) * ln] for r, ln in zip(rows, DEFAULT_AUX)] for k in range(DEFAULT_SLOTS)]
        join, room_row = b"".join, ROOM_ROW.pack
        while True:
            m = recv()
            if m == b"bye":
                break
            slot, rid, _ = ST.unpack(m)
            pair.send(REPLY.pack(slot, join(at[slot]) == expected[rid % POOL] + room_row(_room(rid))))
    elif mode in ("engine-1", "engine-1+gate", "engine-pipe+st"):  # the status on the PAIR (one in flight) or the PULL
        recv = _recv_fn(pull if mode == "engine-pipe+st" else pair, spin, False)
        rooms = _rooms(rows) if mode == "engine-1+gate" else None
        while True:
            m = recv()
            if m == b"bye":
                break
            slot, room, _ = ST.unpack(m)
            if rooms is not None:  # SGLang's readiness gate, then clear_slot when the slot is freed
                landed = int(rooms[slot].item())
                rooms[slot] = 0
                room = room if landed == room else -1
            pair.send(REPLY.pack(slot, room))
    elif mode == "engine-co64":  # SGLang's readiness gate over a step: its rooms read, compared, zeroed at once
        recv = _recv_fn(pull, spin, False)
        rooms, steps = _rooms(rows), np.arange(CO, dtype=np.int64)
        if not isinstance(rooms, np.ndarray):  # torch, on a CUDA device: the rooms come back through pinned memory
            import torch

            host = torch.empty(CO, dtype=torch.int64).pin_memory()
            got, settle = host.numpy(), torch.cuda.current_stream().synchronize
        while True:
            m = recv()
            if m == b"bye":
                break
            slot, room, count = ST.unpack(m)
            if isinstance(rooms, np.ndarray):
                landed = rooms[slot:slot + count].copy()
                rooms[slot:slot + count] = 0
            else:  # one device->host copy, the zero queued behind it, one sync before the reply
                host[:count].copy_(rooms[slot:slot + count], non_blocking=True)
                rooms[slot:slot + count] = 0
                settle()
                landed = got[:count]
            pair.send(REPLY.pack(slot, room if np.array_equal(landed, steps[:count] + room) else -1))
    else:  # tcp-1, tcp-1+gate, tcp-pipe: SGLang's decode thread, its copy a memmove
        recv = _recv_fn(pull, spin, True)
        rooms = _rooms(rows) if mode == "tcp-1+gate" else None
        memmove, unpack = ctypes.memmove, struct.unpack
        while True:
            msg = recv()
            if msg[0] == AUX_DATA:
                field, slot = int(msg[2]), int(msg[3])
                size = unpack(">I", msg[4])[0]
                if len(msg[5]) != size:
                    raise SystemExit("route_floor: AUX_DATA length mismatch")
                memmove(ptrs[field] + AUX[field] * slot, msg[5], size)
            elif len(msg) == 1:  # bye
                break
            else:
                status = int(msg[1])
                if rooms is not None:  # the gate on host rows: the room read, compared, zeroed
                    room = int(msg[0])  # its slot: the AUX_DATA messages' before it
                    status = status if int(rooms[slot]) == room else -1
                    rooms[slot] = 0
                pair.send(REPLY.pack(int(msg[0]), status))
    pair.send(_digest(rows, mode in GATED).encode())  # after bye: the rows as landed
    ctx.destroy(linger=int(WAIT_S * 1000))


def prefill(mode: str, dev: str, rdv: str, n: int, w: int) -> None:
    rows, ptrs, bufs = _rows(mode, _where(mode, dev, "prefill"), True)
    co = mode == "engine-co64"
    n = -(-n // CO) * CO if co else n  # engine-co64: whole steps
    te = _engine(ptrs, mode) if mode.startswith("engine") else None
    quiet = _quiet_glog() if te else True
    end = time.monotonic() + WAIT_S
    while not os.path.exists(rdv):
        if time.monotonic() > end:
            raise SystemExit("route_floor: no decode")
        time.sleep(0.02)
    with open(rdv) as fh:
        info = json.load(fh)
    ctx = zmq.Context()
    pair, push = ctx.socket(zmq.PAIR), ctx.socket(zmq.PUSH)
    for s in (pair, push):
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
        s.setsockopt(zmq.SNDTIMEO, int(WAIT_S * 1000))
    pair.setsockopt(zmq.RCVHWM, 0)
    pair.connect(info["pair"])
    push.connect(info["pull"])
    session = info["session"]
    row_lens, nslots = _layout(mode)
    blocks = [([ptrs[f] + ln * k for f, ln in enumerate(row_lens)],
               [info["ptrs"][f] + ln * k for f, ln in enumerate(row_lens)], list(row_lens)) for k in range(nslots)]
    co_blocks = [([p + ln * k for p, ln in zip(ptrs, AUX)], [p + ln * k for p, ln in zip(info["ptrs"], AUX)],
                  [ln * CO for ln in AUX]) for k in range(0, NSLOTS, CO)] if co else []  # a step's: one a field
    views = [memoryview(r) for r in rows] if mode.startswith("tcp") else []
    payloads = [[views[f][ln * k:ln * (k + 1)] for f, ln in enumerate(AUX)] for k in range(NSLOTS)] if views else []
    fields = [str(f).encode() for f in range(len(AUX))]
    slots = [str(k).encode() for k in range(NSLOTS)]
    lens = [struct.pack(">I", ln) for ln in AUX]
    pc = time.perf_counter
    result: dict = {"mode": mode}
    bad = 0

    def tcp_send(i: int) -> None:
        k, room = i % NSLOTS, str(i + 1).encode()
        pay, slot = payloads[k], slots[k]
        for f in range(10):
            push.send_multipart([AUX_DATA, room, fields[f], slot, lens[f], pay[f]])
        push.send_multipart([room, b"4", b"0"])

    if mode in ONE:
        hand, write = [], []
        sync = te.batch_transfer_sync_write if te else None
        rooms = _rooms(rows) if mode.endswith("+gate") else None
        for i in range(WARM + n):
            k = i % NSLOTS
            if sync:
                t0 = pc()
                if rooms is not None:  # set_buf's room write, on the rows' device, before the write
                    rooms[k] = i + 1
                rc = sync(session, *blocks[k])
                t1 = pc()
                pair.send(ST.pack(k, i + 1, 0))
                r = pair.recv()
                t2 = pc()
            else:
                t0 = pc()
                if rooms is not None:
                    rooms[k] = i + 1
                tcp_send(i)
                r = pair.recv()
                t2 = t1 = pc()
                rc = 0
            bad += rc != 0 or REPLY.unpack(r)[1] != (i + 1 if sync else 4)
            if i >= WARM:
                hand.append(t2 - t0)
                write.append(t1 - t0)
        result["p50"] = statistics.median(hand) * 1e6
        if sync:
            result["write_p50"] = statistics.median(write) * 1e6
    else:
        def sync_pass(count: int, start: int) -> None:
            write = te.batch_transfer_sync_write
            for i in range(start, start + count):
                if write(session, *blocks[i % nslots]) != 0:
                    raise SystemExit("route_floor: batch_transfer_sync_write failed")

        def engine_pass(count: int, start: int, status: bool) -> None:
            """A sliding window of `w` requests: with `status`, a request leaves it when its reply
            is in; without, when its write has landed."""
            submit, wait = te.batch_transfer_async_write, te.get_batch_transfer_status
            flight: collections.deque = collections.deque()
            submitted = landed = replied = 0
            while (replied if status else landed) < count:
                while submitted < count and submitted - (replied if status else landed) < w:
                    i = start + submitted
                    bid = submit(session, *blocks[i % NSLOTS])
                    if bid == 0:
                        raise SystemExit("route_floor: batch_transfer_async_write failed")
                    flight.append((bid, i))
                    submitted += 1
                if flight:
                    bid, i = flight.popleft()
                    if wait([bid]) != 0:
                        raise SystemExit("route_floor: get_batch_transfer_status failed")
                    landed += 1
                    if status:
                        push.send(ST.pack(i % NSLOTS, i + 1, 0))
                if status:
                    while replied < landed:  # the replies already there
                        try:
                            pair.recv(zmq.NOBLOCK)
                            replied += 1
                        except zmq.Again:
                            break
                    if not flight and replied < landed:
                        pair.recv()
                        replied += 1

        def co_pass(count: int, start: int) -> None:
            """engine-co64: steps of CO requests, at most w // CO unanswered; per step the rooms
            written, one async batch write, a status once landed (the loop's wait on its oldest
            write when no reply is waiting) and a reply that frees the step's slots."""
            nonlocal bad
            submit, wait = te.batch_transfer_async_write, te.get_batch_transfer_status
            send, recv, pack, unpack = push.send, pair.recv, ST.pack, REPLY.unpack
            flight: collections.deque = collections.deque()  # (batch, first request) not yet waited for
            started = done = 0
            while done < count // CO:
                while started < count // CO and started - done < w // CO:
                    i = start + started * CO
                    k = i % NSLOTS
                    rooms[k:k + CO] = all_rooms[i:i + CO]  # set_buf's room writes, one op for the step
                    if settle:  # the rooms in on the device before the write reads them
                        settle()
                    bid = submit(session, *co_blocks[k // CO])
                    if bid == 0:
                        raise SystemExit("route_floor: batch_transfer_async_write failed")
                    flight.append((bid, i))
                    started += 1
                if not flight:
                    m = recv()
                else:
                    try:
                        m = recv(zmq.NOBLOCK)
                    except zmq.Again:  # nothing else to do: the oldest write
                        bid, i = flight.popleft()
                        if wait([bid]) != 0:
                            raise SystemExit("route_floor: get_batch_transfer_status failed") from None
                        send(pack(i % NSLOTS, i + 1, CO))
                        continue
                bad += unpack(m)[1] != start + done * CO + 1  # the step's first room, or the gate failed
                done += 1

        pool = [_Req(e) for e in range(POOL)] if mode in INLINE else []
        free = list(range(nslots))
        waits: queue.SimpleQueue = queue.SimpleQueue()  # engine-inline+thr: (batch, slot, rid), None to stop
        failed: list[int] = []  # engine-inline+thr: batches whose wait failed

        def waiter() -> None:
            """engine-inline+thr's second thread: each write waited for in turn, then its status."""
            wait, send, pack = te.get_batch_transfer_status, push.send, ST.pack
            while (item := waits.get()) is not None:
                bid, slot, rid = item
                if wait([bid]) != 0:
                    failed.append(bid)
                send(pack(slot, rid, 0))

        def inline_pass(count: int, start: int) -> None:
            """The default run's shape: a closed loop of INFLIGHT requests, each set_buf, one
            async batch write, a status once landed (the loop's own wait on its oldest write
            when nothing else is to do, or the waiter thread's) and a verdict that frees its slot."""
            nonlocal bad
            set_buf, submit, wait = bufs.set_buf, te.batch_transfer_async_write, te.get_batch_transfer_status
            send, recv, pack, unpack = push.send, pair.recv, ST.pack, REPLY.unpack
            hand = waits.put if mode == "engine-inline+thr" else None
            flight: collections.deque = collections.deque()  # the loop's writes not yet waited for
            started = done = 0
            while done < count:
                while started < count and started - done < INFLIGHT:
                    rid = start + started
                    slot = free.pop()
                    req = pool[rid % POOL]
                    req.bootstrap_room, req.metadata_buffer_index = _room(rid), slot
                    set_buf(req)
                    bid = submit(session, *blocks[slot])
                    if bid == 0:
                        raise SystemExit("route_floor: batch_transfer_async_write failed")
                    (hand or flight.append)((bid, slot, rid))
                    started += 1
                if hand or not flight:
                    m = recv()
                else:
                    try:
                        m = recv(zmq.NOBLOCK)
                    except zmq.Again:  # nothing else to do: the oldest write
                        bid, slot, rid = flight.popleft()
                        if wait([bid]) != 0:
                            raise SystemExit("route_floor: get_batch_transfer_status failed") from None
                        send(pack(slot, rid, 0))
                        continue
                slot, ok = unpack(m)
                bad += ok != 1
                free.append(slot)
                done += 1

        def tcp_pass(count: int, start: int) -> None:
            sent = done = 0
            while done < count:
                while sent < count and sent - done < w:
                    tcp_send(start + sent)
                    sent += 1
                pair.recv()
                done += 1
                while done < sent:
                    try:
                        pair.recv(zmq.NOBLOCK)
                        done += 1
                    except zmq.Again:
                        break

        def one_pass(count: int, start: int) -> None:
            if mode in ("engine-sync", "engine-raw"):
                return sync_pass(count, start)
            if mode == "tcp-pipe":
                return tcp_pass(count, start)
            if mode in INLINE:
                return inline_pass(count, start)
            if co:
                return co_pass(count, start)
            return engine_pass(count, start, mode == "engine-pipe+st")

        thread = threading.Thread(target=waiter, daemon=True) if mode == "engine-inline+thr" else None
        if thread:
            thread.start()
        warm = max(WARM, 2 * w)
        if co:  # whole steps; request i's room is i + 1 (as engine-1+gate's), all of them prebuilt where the rows are
            warm = -(-warm // CO) * CO
            rooms = _rooms(rows)
            if isinstance(rooms, np.ndarray):
                all_rooms, settle = np.arange(1, warm + n + 1, dtype=np.int64), None
            else:
                import torch

                all_rooms = torch.arange(1, warm + n + 1, dtype=torch.int64, device=rooms.device)
                settle = torch.cuda.current_stream().synchronize
        one_pass(warm, 0)
        pids = (os.getpid(), info["pid"])
        c0, b0 = [_cpu_s(p) for p in pids], box()[0]
        t0 = pc()
        one_pass(n, warm)
        wall = pc() - t0
        cpu = [_cpu_s(p) - c for p, c in zip(pids, c0)]
        result.update(rate=n / wall, cpu_us=[c / n * 1e6 for c in cpu],  # prefill, decode
                      others=max(0.0, box()[0] - b0 - sum(cpu)) / wall)  # cores busy outside both
        if thread:
            waits.put(None)
            thread.join()
        bad += len(failed)
    (push if mode.startswith("tcp") or mode in ("engine-pipe+st", "engine-co64") + INLINE else pair).send(b"bye")
    landed = pair.recv().decode()
    result.update(bad=bad, quiet=quiet and info["quiet"],
                  intact=landed == _digest(rows, mode in GATED) if WARM + n >= nslots else None)
    print("RESULT " + json.dumps(result), flush=True)
    ctx.destroy(linger=0)


# ---- the driver --------------------------------------------------------------------------
def _loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def _transport(log: str) -> str:
    for pattern, name in _TRANSPORTS:
        if pattern.search(log):
            return name
    return "?"


def run_one(mode: str, dev: str, n: int, w: int, tmp: str, env: dict[str, str]) -> tuple[dict, str]:
    """One run of one mode: the decode and the prefill, each killed if still alive at the end."""
    rdv = os.path.join(tmp, f"{mode}.json")
    if os.path.exists(rdv):
        os.remove(rdv)
    logs = {k: os.path.join(tmp, f"{k}.log") for k in ("decode", "prefill", "result")}
    me = os.path.abspath(__file__)
    procs: list[subprocess.Popen] = []
    try:
        with open(logs["decode"], "w") as dlog, open(logs["prefill"], "w") as plog, open(logs["result"], "w") as res:
            procs.append(subprocess.Popen([sys.executable, me, "--decode", mode, dev, rdv, str(n)],
                                          stdout=dlog, stderr=subprocess.STDOUT, env=env))
            procs.append(subprocess.Popen([sys.executable, me, "--prefill", mode, dev, rdv, str(n), str(w)],
                                          stdout=res, stderr=plog, env=env))
            end = time.monotonic() + _limit_s(n)
            while procs[1].poll() is None and procs[0].poll() in (None, 0) and time.monotonic() < end:
                time.sleep(0.1)  # a decode that died ends the run at once
            if procs[1].poll() == 0:
                procs[0].wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = {}
    for k, path in logs.items():
        with open(path) as fh:
            text[k] = fh.read()
    log, dlog_text, out = text["prefill"], text["decode"], text["result"]
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines or procs[1].returncode != 0:
        tail = log.strip().splitlines()[-4:] + dlog_text.strip().splitlines()[-4:]
        raise SystemExit(f"route_floor: {mode} failed (prefill rc {procs[1].returncode}, decode rc "
                         f"{procs[0].returncode}): " + " | ".join(tail))
    return json.loads(lines[-1][7:]), _transport(log) if mode.startswith("engine") else ""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--decode":
        return decode(*sys.argv[2:5], int(sys.argv[5]))
    if len(sys.argv) > 1 and sys.argv[1] == "--prefill":
        return prefill(*sys.argv[2:5], int(sys.argv[5]), int(sys.argv[6]))
    if len(sys.argv) < 2 or sys.argv[1] not in ("cpu", "gpu"):
        raise SystemExit("usage: python tools/route_floor.py cpu|gpu [N] [ROUNDS] [W] [MODES]")
    dev = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    w = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    every = ONE + RATE + DEFAULT_ROW
    modes = tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 else every if dev == "cpu" else ONE + RATE
    if not set(modes) <= set(every):
        raise SystemExit(f"route_floor: MODES is a comma list of {', '.join(every)}")
    co_ok = not w % CO and CO <= w <= NSLOTS
    if len(sys.argv) <= 5 and not co_ok:  # the default list: engine-co64 only where W is whole steps
        modes = tuple(m for m in modes if m != "engine-co64")
        print(f"(engine-co64 left out: W={w} is not a multiple of {CO} from {CO} to {NSLOTS})")
    if "engine-co64" in modes and not co_ok:
        raise SystemExit(f"route_floor: engine-co64 needs W a multiple of {CO} from {CO} to {NSLOTS} (whole steps "
                         f"in flight, no slot reused while in flight), not {w}")
    env = dict(os.environ)
    if dev == "gpu":
        env["MC_INTRANODE_NVLINK"] = "1"
        env.pop("MC_FORCE_TCP", None)
    else:
        env["MC_FORCE_TCP"] = "1"
        env.pop("MC_INTRANODE_NVLINK", None)
        # the TCP transport fails blocks past its per-peer lane queue (1024 queued + 1024
        # waiting by default): room for the window's 10 blocks a request
        for k in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
            env[k] = str(max(1024, 10 * w))
    got: dict[str, list[dict]] = {m: [] for m in modes}
    transports, notes = set(), set()
    loud = 0  # runs started on a box still busy after QUIET_WAIT_S
    with tempfile.TemporaryDirectory(prefix="route-floor-") as tmp:
        for _ in range(rounds):  # interleaved rounds
            for m in modes:
                loud += dev == "cpu" and wait_quiet(QUIET_WAIT_S, QUIET) > QUIET_WAIT_S
                r, t = run_one(m, dev, n, w, tmp, env)
                got[m].append(r)
                if t:
                    transports.add(t)
                if r["bad"]:
                    notes.add(f"{m}: {r['bad']} failed writes or wrong replies in a run")
                if r["intact"] is False:
                    notes.add(f"{m}: the decode's rows differ from the prefill's after a run")
                if not r["quiet"]:
                    notes.add("Mooncake's per-batch INFO log could not be silenced (glog not found)")

    def med(m: str, key: str) -> tuple[float, list[float]]:
        v = [r[key] for r in got[m]]
        return statistics.median(v), v

    where = ("engine rows on cuda:0 -> cuda:" + os.environ.get("IDEAL_GPU_D", "0") + ", MC_INTRANODE_NVLINK=1"
             if dev == "gpu" else f"engine rows in host memory, MC_FORCE_TCP=1, MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER="
             f"{env['MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER']} (and PENDING_ADMISSIONS)")
    print(f"route floor: one DeepSeek-V3 MTP aux row (10 fields, {sum(AUX):,} B, {NSLOTS} slots)"
          + (f", the default modes on SGLang 0.5.23's default row (10 fields, {sum(DEFAULT_AUX):,} B, "
             f"{DEFAULT_SLOTS} slots)" if set(modes) & set(DEFAULT_ROW) else "")
          + f", {dev}: {where}, Mooncake transport from its log: {'/'.join(sorted(transports))}; tcp route on "
          f"host rows; {n} requests a run, {rounds} interleaved rounds; load {_loadavg()}")
    print("one in flight: p50 us (median of rounds) [rounds]")
    rows = [("engine-1", "p50", "sync batch write + 24-B status + 16-B reply"),
            ("engine-1", "write_p50", "  of it, the sync batch write alone"),
            ("engine-1+gate", "p50", "engine-1 + SGLang's room written, gated (.item()) and zeroed"),
            ("tcp-1", "p50", "10 AUX_DATA + status, payloads memmoved into rows, 16-B reply"),
            ("tcp-1+gate", "p50", "tcp-1 + the same room written, gated and zeroed (host)")]
    for m, key, what in rows:
        if m in modes:
            v, per = med(m, key)
            print(f"  {v:10.1f}  {m:15s} {what} {[round(x, 1) for x in per]}")
    print(f"per request: requests/s (median of rounds) [rounds], W={w}; CPU us a request, prefill + decode, "
          "every thread (median of rounds)")
    whats = {"engine-sync": "sync batch writes back to back (W=1)",
             "engine-pipe": f"async batch writes, {w} in flight, writes only",
             "engine-pipe+st": f"the same + 24-B status PUSH and 16-B reply per request, {w} unanswered",
             "tcp-pipe": f"10 AUX_DATA + status per request, 16-B reply, {w} unanswered",
             "engine-co64": f"steps of {CO} slots: rooms written, 10-block async write, 24-B status, rooms "
                            f"gated and zeroed, 16-B reply; {w // CO} unanswered",
             "engine-raw": "default rows: sync batch writes back to back (W=1), the bench's raw",
             "engine-inline": f"default rows, {INFLIGHT} in flight closed loop: set_buf, async write, the loop "
                              "waits its oldest, status, row checked, verdict",
             "engine-inline+thr": "the same, a waiter thread waits each write and sends its status"}
    for m in RATE + DEFAULT_ROW:
        if m in modes:
            v, per = med(m, "rate")
            cpu = [statistics.median(r["cpu_us"][k] for r in got[m]) for k in (0, 1)]
            print(f"  {v:10,.0f}  {m:17s} {whats[m]} {[round(x) for x in per]}; "
                  f"CPU {cpu[0]:.0f} + {cpu[1]:.0f} = {sum(cpu):.0f} us; other work on the box "
                  f"{[round(r['others'], 2) for r in got[m]]} cores")

    def ratio(a: str, ka: str, b: str, kb: str) -> tuple[float, list[float], str]:
        """The ratio of medians, per round, and over the quiet rounds where some were not."""
        per = [x[ka] / y[kb] for x, y in zip(got[a], got[b])]
        quiet = [(x[ka], y[kb]) for x, y in zip(got[a], got[b]) if max(x.get("others", 0), y.get("others", 0)) < QUIET]
        mq = statistics.median
        note = (f"; quiet rounds {mq(x for x, _ in quiet) / mq(y for _, y in quiet):.2f}x ({len(quiet)} of {len(per)})"
                if quiet and len(quiet) < len(per) else "")
        return med(a, ka)[0] / med(b, kb)[0], per, note

    print("floors (transports alone; G5 with SGLang's set_buf; none of this project's code): ratio of medians "
          "[per round]")
    floors = (("G1  tcp-1 / engine-1 one in flight:    ", "tcp-1", "p50", "engine-1", "p50",
               "goal: tcp route / NVLink handoff p50 >= 2x"),
              ("G1g tcp-1+gate / engine-1+gate:        ", "tcp-1+gate", "p50", "engine-1+gate", "p50",
               "(G1 with SGLang's per-handoff room on both routes)"),
              ("G2  engine-pipe / tcp-pipe per request:", "engine-pipe", "rate", "tcp-pipe", "rate",
               "goal: per-request NVLink / tcp route >= 3x"),
              ("    engine-sync / tcp-pipe:            ", "engine-sync", "rate", "tcp-pipe", "rate",
               "(the engine's W=1: on NVLink it can beat the window)"),
              ("    engine-pipe+st / tcp-pipe:         ", "engine-pipe+st", "rate", "tcp-pipe", "rate",
               "(the same control path on both routes)"),
              ("G5  engine-inline / engine-raw:        ", "engine-inline", "rate", "engine-raw", "rate",
               "goal: 2-core CPU box, the default run >= 0.8x raw"),
              ("    engine-inline+thr / engine-raw:    ", "engine-inline+thr", "rate", "engine-raw", "rate",
               "(the writes waited for on a second thread)"),
              ("co  engine-co64 / engine-pipe+st:      ", "engine-co64", "rate", "engine-pipe+st", "rate",
               "goal: NVLink coalesced b64 >= 20x per-request (2-core CPU box: >= 10x)"))
    for label, a, ka, b, kb, goal in floors:
        if a in modes and b in modes:
            r, per, note = ratio(a, ka, b, kb)
            print(f"  {label}   {r:6.2f}x {[round(x, 2) for x in per]}   {goal}{note}")
    if "engine-co64" in modes:
        v, per = med("engine-co64", "rate")
        label = f"co  engine-co64 / {CO_GOAL:,}/s:"
        print(f"  {label:39s}   {v / CO_GOAL:6.2f}x {[round(x) for x in per]}   goal: NVLink coalesced b64 >= "
              f"{CO_GOAL:,} handoffs/s; the goal's floor: a careful coalesced loop reaches {v:,.0f}/s")
    intact = all(r["intact"] for v in got.values() for r in v)
    print(f"load after: {_loadavg()}" + (f"; {loud} runs started on a box not quiet after {QUIET_WAIT_S:.0f} s"
                                          if loud else ""))
    print(f"rows landed intact (decode's rows == prefill's after every run): {'yes' if intact else 'see notes'}")
    for note in sorted(notes):
        print(f"warning: {note}")
    if notes:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
