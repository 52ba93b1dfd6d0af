"""The device floor under a one-in-flight handoff's seal and read, each CUDA call timed alone
(issue 39): what one wait costs on an idle device, one tiny kernel and its wait, our prefill's
seal of one row (fill=ahead: signed on the host, one graph replay writing room and tag) and its
wait, and our decode's read of one row (one graph replay: digest, room zeroed) with its wait.

    python tools/seal_floor.py [ITERS]        # on a CUDA machine; run it under an MPS daemon too

What the run's process adds around the same calls, one at a time (environment):
  SEAL_FLOOR_GAP_US=N    each timed call follows a sleep of N us (the run's loop blocks in its
                         poll between handoffs: its core may idle, its caches cool)
  SEAL_FLOOR_CHURN=N     each timed call follows N rounds of unrelated Python work (json, dicts,
                         lists: another code path running through the caches, as the run's loop
                         does between two seals)
  SEAL_FLOOR_ENGINE=1    a Mooncake engine in the process, as the run's prefill has one
                         (MC_INTRANODE_NVLINK=1, P2PHANDSHAKE on 127.0.0.1; the buffers registered)

Prints the p50 of each, in microseconds (one process: no peer, no transport). The indented rows
split the seal and the read: what of them is a CUDA call timed alone (a graph replay), what is
our host code around it; the last two are SGLang's own room write (the yardstick's
YARDSTICK_ROOM=1 step), for comparison."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from orchestrator import MetadataBuffers
from orchestrator.handoff.digest import Keys, RowDigest

GAP_S = float(os.environ.get("SEAL_FLOOR_GAP_US", "0")) / 1e6
CHURN = int(os.environ.get("SEAL_FLOOR_CHURN", "0"))


def _churn(n: int) -> None:
    for i in range(n):
        d = {"rid": i, "room": i * 7919, "slot": i % 64, "t": [1.5, 2.5, float(i)], "why": "x" * (i % 13)}
        json.dumps(d)
        sorted(d.items())
        [k for k in d if k != "slot"]


def _p50(f, iters: int) -> float:
    for _ in range(50):
        f()
    times = []
    for _ in range(iters):
        if GAP_S:
            time.sleep(GAP_S)
        if CHURN:
            _churn(CHURN)
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(times), 1)


def _engine(b: MetadataBuffers) -> object:
    """A Mooncake engine in this process, as the run's prefill has (NVLink intra-node)."""
    os.environ["MC_INTRANODE_NVLINK"] = "1"
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    for t in b.fields:
        assert te.register_memory(t.data_ptr(), t.numel() * t.element_size()) == 0
    return te


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    dev = torch.device("cuda", 0)
    # DeepSeek-V3 MTP's rows (experiment=deepseek_v3_mtp: hidden 7168, bf16), 64 slots
    b = MetadataBuffers(64, 7168, torch.bfloat16, 16, device=dev, kv_checksum_enabled=True)
    engine = _engine(b) if os.environ.get("SEAL_FLOOR_ENGINE") else None  # noqa: F841 (kept alive)
    d = RowDigest(b, Keys(b"k" * 32))
    d.warm_seal(1)
    d.warm()
    d.freeze()
    x = torch.zeros(1, device=dev)
    slots, rooms, idents = [3], [12345], [(0, 7)]
    pads = [Keys(b"k" * 32).pad(0, 7)]

    def seal_host() -> None:
        d.seal(slots, rooms, pads, idents, ahead=True)

    def seal_and_wait() -> None:
        d.seal(slots, rooms, pads, idents, ahead=True)
        torch.cuda.synchronize()

    def tiny() -> None:
        x.add_(1)
        torch.cuda.synchronize()

    def read() -> None:
        d.read(slots, idents, clear=[5])

    def sign() -> None:
        d.sign_rooms(slots, rooms, pads, idents)

    wgraph = d._write[1].next()[0]  # the seal's write graph of a one-row step (its inputs as last set)
    rgraph = d._judge[1][0]  # the read's graph of a one-row step

    def write_replay() -> None:
        wgraph.replay()

    def read_replay() -> None:
        rgraph.replay()
        torch.cuda.current_stream(dev).synchronize()

    roomv = b.fields[b.room_field].view(torch.int64).view(b.size, -1)

    def room_scalar() -> None:
        roomv[3, 0] = 12345

    def room_scalar_wait() -> None:
        roomv[3, 0] = 12345
        torch.cuda.synchronize()

    rows = {
        "torch.cuda.synchronize() on an idle device": _p50(torch.cuda.synchronize, iters),
        "one tiny kernel + synchronize": _p50(tiny, iters),
        "seal, host side only (sign + replay queued)": _p50(seal_host, iters),
        "seal + synchronize (the prefill's fill_digest floor, fill=ahead)": _p50(seal_and_wait, iters),
        "read one row + zero one freed (the decode's device pass, waited for)": _p50(read, iters),
        "  of the seal: sign_rooms alone (host arithmetic, no CUDA call)": _p50(sign, iters),
        "  of the seal: its write graph replayed alone, no wait (one CUDA call)": _p50(write_replay, iters),
        "  of the read: its graph replayed + synchronize alone (CUDA calls)": _p50(read_replay, iters),
        "SGLang's room write, bootstrap_room[slot, 0] = room (set_buf's), no wait": _p50(room_scalar, iters),
        "the same + synchronize (the yardstick's YARDSTICK_ROOM=1 write, waited for)": _p50(room_scalar_wait, iters),
    }
    extra = [f"{k}={os.environ[k]}" for k in ("SEAL_FLOOR_GAP_US", "SEAL_FLOOR_CHURN", "SEAL_FLOOR_ENGINE")
             if os.environ.get(k)]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {iters} iterations, p50 us"
          f"{' (' + ', '.join(extra) + ')' if extra else ''}:")
    for name, us in rows.items():
        print(f"  {us:8.1f}  {name}")


if __name__ == "__main__":
    main()
