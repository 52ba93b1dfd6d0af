"""Where a decode-side verification of one row goes on a GPU (run on the device machine):
python tools/profile_verify.py [hidden] [dtype]. Times each step of MetadataBuffers.row_snapshot
(gather index, index_select, device->host copy, bytes) and the checksum, 2000 times each, and
an alternative (one non_blocking copy into pinned memory + stream sync)."""

from __future__ import annotations

import ctypes
import hashlib
import statistics
import sys
import time

import torch

from orchestrator import MetadataBuffers

hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 7168
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
torch.cuda.set_device(0)
b = MetadataBuffers(128, hidden, dtype, device="cuda:0")
N = 2000


def timed(fn):
    fn()
    torch.cuda.synchronize()
    out = []
    for i in range(N):
        t = time.perf_counter()
        fn(i % 128)
        out.append((time.perf_counter() - t) * 1e6)
    return round(statistics.median(out), 2)


b.row_snapshot(0)  # builds the gather index
gather_base, gather_step = b._gather
idx = torch.add(gather_base, gather_step, alpha=3)
row = b._arena.index_select(0, idx)
host = row.cpu()
pinned = torch.empty(b.row_bytes, dtype=torch.uint8, pin_memory=True)
snap = ctypes.string_at(host.data_ptr(), host.numel())
steps = {
    "row_snapshot (total)": lambda s=0: b.row_snapshot(s),
    "  torch.add (gather index)": lambda s=0: torch.add(gather_base, gather_step, alpha=s),
    "  index_select (+add)": lambda s=0: b._arena.index_select(0, idx),
    "  .cpu() of the row (sync copy)": lambda s=0: row.cpu(),
    "  string_at": lambda s=0: ctypes.string_at(host.data_ptr(), host.numel()),
    "blake2b of the row": lambda s=0: hashlib.blake2b(snap, digest_size=16).hexdigest(),
    "room .item() alone": lambda s=0: b.room(s),
    "alt: index_select + copy_ to pinned, non_blocking + sync": lambda s=0: (
        pinned.copy_(b._arena.index_select(0, idx), non_blocking=True), torch.cuda.current_stream().synchronize()),
}
print(f"row {b.row_bytes} B on {torch.cuda.get_device_name(0)}; median of {N} in us")
for name, fn in steps.items():
    print(f"{name:<58} {timed(fn)}")
