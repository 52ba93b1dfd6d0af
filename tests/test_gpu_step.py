"""The per-step device work on CUDA rows (marker `gpu`): the seal and read graphs give the
host's digests and bytes, staged set_buf lands SGLang's exact bytes, the engine never reads
a row before the step's writes landed, and a re-granted slot is never written before its
room was zeroed."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from orchestrator import MetadataBuffers
from orchestrator.buffers import StagedRows
from orchestrator.config import WorkloadConfig
from orchestrator.digest import SIGNATURE, Keys, RowDigest
from orchestrator.workload import RequestPool, Shapes

from .test_digest import SECRET, _filled

pytestmark = pytest.mark.gpu


def _pads(idents):
    return [Keys(SECRET).pad(*i) for i in idents]


@pytest.mark.parametrize("k", [1, 3, 4, 6])
def test_seal_graph_writes_and_signs_as_the_host_does(k):
    dev, host = _filled("cuda", size=8, kv_checksum_enabled=True), _filled("cpu", size=8, kv_checksum_enabled=True)
    assert torch.equal(dev.arena.cpu(), host.arena)
    dd, hd = RowDigest(dev, Keys(SECRET)), RowDigest(host, Keys(SECRET))
    dd.warm_seal(8)
    assert torch.equal(dev.arena.cpu(), host.arena)  # capturing wrote nothing into the rows
    slots = [7, 2, 5, 0, 3, 6][:k]
    rooms = [(1 << 63) + 5 + i for i in range(k)]
    idents = [(1, 40 + i) for i in range(k)]
    sealed = dd.seal(slots, rooms, _pads(idents), idents)
    dev.sync()
    want = hd.seal(slots, rooms, _pads(idents), idents).result()
    assert sealed.result() == want
    assert torch.equal(dev.arena.cpu(), host.arena)  # rooms and (tag, signature) written alike
    assert [dev.get_kv_checksum(s) for s in slots] == [(t, SIGNATURE) for t in want[0]]


def test_read_graph_and_queued_clears_match_the_host():
    dev, host = _filled("cuda", size=8, kv_checksum_enabled=True), _filled("cpu", size=8, kv_checksum_enabled=True)
    dd, hd = RowDigest(dev, Keys(SECRET)), RowDigest(host, Keys(SECRET))
    dd.warm()
    idents = [(0, i) for i in range(5)]
    for b in (dev, host):
        b.clear_slots([1, 6])
    assert dd.read([0, 2, 3, 4, 5], idents) == hd.read([0, 2, 3, 4, 5], idents)  # its one wait covers the clears
    assert dev.room(1) == dev.room(6) == 0 and torch.equal(dev.arena.cpu(), host.arena)


def test_staged_set_buf_lands_the_bytes_sglang_set_buf_does():
    kw = dict(kv_checksum_enabled=True, output_dsa_topk_indices_dim=8, enable_sampling_mask=True)
    ref = MetadataBuffers(16, 7168, torch.bfloat16, 64, device="cuda", **kw)
    out = MetadataBuffers(16, 7168, torch.bfloat16, 64, device="cuda", **kw)
    rows = StagedRows(out)
    dr, do = RowDigest(ref, Keys(SECRET)), RowDigest(out, Keys(SECRET))
    dr.warm_seal(8)
    do.warm_seal(8, rows)
    w = WorkloadConfig(return_logprob=True)
    pool = RequestPool(w, Shapes(7168, torch.bfloat16, 0, 64, device="cuda"), size=8)
    steps = [[3, 9, 4], [0], [15, 14, 13, 12, 11], [3, 4]]  # slots reused: untouched columns too
    rid = 0
    for slots in steps:
        reqs = [pool.get(rid + i, s) for i, s in enumerate(slots)]
        rid += len(slots)
        idents = [(0, r.rid) for r in reqs]
        rooms = [r.bootstrap_room for r in reqs]
        for r in reqs:
            ref.set_buf(r)
            rows.set_buf(r)
        a = dr.seal(slots, rooms, _pads(idents), idents).result()
        b = do.seal(slots, rooms, _pads(idents), idents, rows=rows).result()
        assert a == b
        assert torch.equal(ref.arena, out.arena)


def _decode_side(conn):
    from orchestrator.transport.engine import MooncakeEngine

    torch.cuda.set_device(0)
    eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "nvlink_intra", env={"MC_INTRANODE_NVLINK": "1"})
    buf = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    eng.register(buf.data_ptr(), buf.numel())
    conn.send((eng.session_id, buf.data_ptr()))
    while conn.recv() == "check":
        torch.cuda.synchronize()
        conn.send(buf[:4096].cpu())


def test_the_engine_never_reads_a_row_before_the_steps_writes_landed():
    """The prefill's row writes are queued behind ~50 ms of device work and the NVLink write
    is submitted with no wait of ours (engine_orders_writes): what lands is the new row."""
    from orchestrator.transport.engine import MooncakeEngine

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child,), daemon=True)
    proc.start()
    try:
        eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "nvlink_intra", env={"MC_INTRANODE_NVLINK": "1"})
        assert parent.poll(120)
        session, dst = parent.recv()
        src = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        eng.register(src.data_ptr(), src.numel())
        assert torch.cuda.current_stream().cuda_stream == 0  # torch's legacy default stream
        for value in (7, 99, 201):
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU cycles queued first
            src.fill_(value)  # the step's write, queued behind it
            eng.wait(eng.submit(session, [src.data_ptr()], [dst], [4096]))  # no sync of ours
            parent.send("check")
            landed = parent.recv()
            assert torch.all(landed == value), (value, landed[:8])
    finally:
        parent.send("stop")
        proc.join(20)
