"""The per-step device work on CUDA rows (marker `gpu`): the seal and read graphs give the
host's digests and bytes, staged set_buf lands SGLang's exact bytes, the engine never reads
a row before the step's writes landed, and a re-granted slot is never written before its
room was zeroed."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from orchestrator import MetadataBuffers
from orchestrator.handoff.buffers import StagedRows
from orchestrator.handoff.digest import SIGNATURE, Keys, RowDigest
from orchestrator.handoff.workload import RequestPool, Shapes
from orchestrator.profile.config import WorkloadConfig

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


@pytest.mark.parametrize("k", [1, 2, 5])
def test_ahead_seal_signs_on_the_host_and_writes_rooms_and_tags_alike(k):
    dev, host = _filled("cuda", size=8, kv_checksum_enabled=True), _filled("cpu", size=8, kv_checksum_enabled=True)
    dd, hd = RowDigest(dev, Keys(SECRET)), RowDigest(host, Keys(SECRET))
    dd.warm_seal(8)
    dd.freeze()
    hd.freeze()
    slots, rooms = [6, 1, 3, 0, 7][:k], [11 + i for i in range(k)]
    idents = [(0, 90 + i) for i in range(k)]
    got = dd.seal(slots, rooms, _pads(idents), idents, ahead=True).result()
    dev.sync()
    assert got == hd.seal(slots, rooms, _pads(idents), idents, ahead=True).result()
    assert torch.equal(dev.arena.cpu(), host.arena)
    assert got == hd.sign(slots, idents, _pads(idents))  # == the full digest of the rows now


@pytest.mark.parametrize("clear", [[1, 6], [1, 6, 7]])
def test_read_graph_zeroes_freed_rooms_in_the_same_pass(clear):
    dev, host = _filled("cuda", size=8, kv_checksum_enabled=True), _filled("cpu", size=8, kv_checksum_enabled=True)
    dd, hd = RowDigest(dev, Keys(SECRET)), RowDigest(host, Keys(SECRET))
    dd.warm()
    idents = [(0, i) for i in range(2)]
    # two slots read, two or three freed: one replay of the bucket that holds them (2 or 4) zeroes them
    assert dd.read([0, 2], idents, clear=clear) == hd.read([0, 2], idents, clear=clear)
    assert all(dev.room(s) == 0 and dev.get_kv_checksum(s) == (0, 0) for s in clear)
    assert torch.equal(dev.arena.cpu(), host.arena)


def test_read_graph_zeroes_more_freed_slots_than_it_reads_in_its_one_replay(monkeypatch):
    """The read's bucket holds its reads and its freed slots: five zeroed beside one read,
    no zeroing queued outside the replay, one wait."""
    dev, host = _filled("cuda", size=8, kv_checksum_enabled=True), _filled("cpu", size=8, kv_checksum_enabled=True)
    dd, hd = RowDigest(dev, Keys(SECRET)), RowDigest(host, Keys(SECRET))
    dd.warm()
    clear = [1, 3, 4, 6, 7]
    want = hd.read([2], [(0, 2)], clear=clear)
    monkeypatch.setattr(dev, "clear_slots", lambda slots: pytest.fail(f"zeroed outside the replay: {slots}"))
    waits = _count_waits(monkeypatch)
    assert dd.read([2], [(0, 2)], clear=clear) == want
    assert waits == [1]
    assert all(dev.room(s) == 0 and dev.get_kv_checksum(s) == (0, 0) for s in clear)
    assert torch.equal(dev.arena.cpu(), host.arena)


def _count_waits(monkeypatch) -> list[int]:
    """[n]: the stream and device syncs since (one list, counted in place)."""
    n = [0]
    for owner, name in ((torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")):
        real = getattr(owner, name)

        def counted(*a, _real=real, **kw):
            n[0] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(owner, name, counted)
    return n


def test_a_tp_ranks_freed_slots_are_zeroed_in_its_next_pass_and_freed_after_its_one_wait(monkeypatch):
    """Device rows of a TP rank (read_plain): a freed slot stays held until the next step's
    pass zeroed it (the read's replay, or a pass of its own when nothing is read), one wait
    a step either way."""
    from orchestrator.handoff.buffers import SlotAllocator
    from orchestrator.handoff.endpoints.decode_state import Grant
    from orchestrator.handoff.endpoints.judge import Rows
    from orchestrator.profile.kinds import GateRead
    from orchestrator.results.outcomes import KVPoll

    dev, host = _filled("cuda", size=8, kv_checksum_enabled=True), _filled("cpu", size=8, kv_checksum_enabled=True)
    dd, hd = RowDigest(dev, Keys(SECRET)), RowDigest(host, Keys(SECRET))
    dd.warm()
    slots = SlotAllocator(8)
    for s in range(8):
        slots.take(s)
    rows = Rows(dev, dd, slots, GateRead.batched, True)
    done = Grant(0, 5, 55, 5, (0, 0), 0.0, status=int(KVPoll.Success))
    waiting = Grant(0, 6, 66, 6, (0, 0), 0.0)
    rows.free(3)
    rows.zero_freed()  # the step's end: nothing zeroed, nothing freed yet
    assert slots.available == 0 and dev.room(3) != 0
    waits = _count_waits(monkeypatch)
    got = rows.read_plain([waiting, done])  # the next step reads slot 5 and zeroes slot 3
    assert waits == [1] and slots.available == 1 and dev.room(3) == 0 and dev.get_kv_checksum(3) == (0, 0)
    assert got[0] is None and got[1] == hd.read([5], [(0, 5)])[0]
    rows.free(5)
    assert rows.read_plain([waiting]) == [None]  # nothing to read: a pass of its own
    assert waits == [2] and slots.available == 2 and dev.room(5) == 0
    host.clear_slots([3, 5])
    assert torch.equal(dev.arena.cpu(), host.arena)


def test_tensors_allocated_after_the_captures_are_never_written_by_a_replay():
    """Every tensor a captured graph reads or writes lives as long as the graph: memory
    dropped after the capture went back to the allocator, the request pool's device tensors
    were given it, and every seal replay overwrote them (rid 256 = pool entry 0 again, sealed
    with other bytes, seen on an H200)."""
    dev = _filled("cuda", size=8, kv_checksum_enabled=True)
    rows = StagedRows(dev)
    dd = RowDigest(dev, Keys(SECRET))
    dd.warm_seal(8, rows)
    dd.warm()
    dd.freeze()
    import gc

    gc.collect()
    probes = [torch.full((n,), 7, dtype=torch.int64, device="cuda") for n in (1, 2, 4, 8, 16, 64, 256, 4096)]
    for i in range(12):
        slots = [i % 8, (i + 3) % 8][: 1 + i % 2]
        idents = [(0, 100 + i + j) for j in range(len(slots))]
        rooms = [50 + i + j for j in range(len(slots))]
        dd.seal(slots, rooms, _pads(idents), idents, rows=rows if i % 3 == 0 else None).result()
        dd.seal(slots, rooms, _pads(idents), idents, ahead=True).result()
        dd.read(slots, idents, clear=[(i + 5) % 8])
    torch.cuda.synchronize()
    assert all(bool((p == 7).all()) for p in probes)


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
    from orchestrator.handoff.backends.mooncake.engine import MooncakeEngine

    torch.cuda.set_device(0)
    eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "nvlink_intra", env={"MC_INTRANODE_NVLINK": "1"})
    buf = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    eng.register(buf.data_ptr(), buf.numel())
    conn.send((eng.session_id, buf.data_ptr()))
    while conn.recv() == "check":
        torch.cuda.synchronize()
        conn.send(buf[:4096].cpu())


@pytest.mark.parametrize("completion", ["wait", "landed"])
def test_the_engine_never_reads_a_row_before_the_steps_writes_landed(completion):
    """The prefill's row writes are queued behind ~50 ms of device work and the NVLink write
    is submitted with no wait of ours (engine_orders_writes): what lands is the new row. Its
    completion is the engine's wait, or (`landed`, the loop's) the batch status asked without
    waiting (completion.py), which the CUDA 13 wheel exports: done means landed there too."""
    import time

    from orchestrator.handoff.backends.mooncake.engine import MooncakeEngine

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
            batch, t0 = eng.submit(session, [src.data_ptr()], [dst], [4096]), time.monotonic()  # no sync of ours
            if completion == "wait":
                eng.wait(batch)
            else:
                assert eng.polls
                while not eng.landed(batch, t0, 4096):
                    pass
            parent.send("check")
            landed = parent.recv()
            assert torch.all(landed == value), (value, landed[:8])
    finally:
        parent.send("stop")
        proc.join(20)


def test_reused_slots_are_zeroed_before_they_are_granted_again(run_job, tmp_path):
    """Four decode rows for thousands of requests: every slot is freed and granted again all
    the time. A zeroing that landed after the next tenant's write would leave its room 0
    (the gate holds it until transport.timeout_s, then room_never_landed) or a torn row."""
    from orchestrator.profile.platform import detect

    for fill in ("inline", "ahead"):
        res = run_job(tmp_path / fill, "mem_pool=INTRA_NODE_NVLINK", "buffers.size=4", "workload.concurrency=4",
                      "workload.requests=3000", "buffers.kv_checksum_enabled=true", f"workload.fill={fill}",
                      "transport.timeout_s=5", platform=detect())
        print(fill, res.verified, res.failure_reasons, res.timing.handoffs_per_s,
              "gate waits", res.decode["decode"].gate_waits)
        assert (res.verified, res.failed, res.corrupted) == (3000, 0, 0), res.failure_reasons


def test_steps_sealed_back_to_back_without_a_wait_each_keep_their_own_tags():
    """The scheduler seals step after step without waiting (the transfer thread reads each
    step's tags later): a bucket's pinned buffers are reused only once read."""
    dev, host = _filled("cuda", size=8, kv_checksum_enabled=True), _filled("cpu", size=8, kv_checksum_enabled=True)
    dd, hd = RowDigest(dev, Keys(SECRET)), RowDigest(host, Keys(SECRET))
    dd.warm_seal(8)
    got, want = [], []
    for i in range(40):
        slots, rooms, idents = [i % 8], [1000 + i], [(0, i)]
        torch.cuda._sleep(1_000_000)  # the device runs behind the host
        got.append(dd.seal(slots, rooms, _pads(idents), idents))
        want.append(hd.seal(slots, rooms, _pads(idents), idents).result())
    assert [s.result() for s in got] == want


@pytest.mark.parametrize("mode", ["sglang", "batched", "side_stream"])
def test_gate_reads_agree_and_a_loaded_decode_reports_its_forward_rate(run_job, tmp_path, mode):
    """CUDA rows, decode loaded with a 2 ms forward: each gate.read verifies every handoff with
    the verdicts of an unloaded batched run; the forward loop's steps/s with and without
    handoffs are reported."""
    from orchestrator.profile.platform import detect
    from orchestrator.sweep.replay import deterministic

    outs = {}
    for name, extra in (("reference", ["gate.read=batched"]),
                        (mode, [f"gate.read={mode}", "endpoints.decode_load.step_ms=2",
                                "endpoints.decode_load.idle_s=0.3"])):
        res = run_job(tmp_path / name, "mem_pool=INTRA_NODE_NVLINK", "workload.requests=300", "workload.seed=5",
                      *extra, platform=detect())
        print(name, res.latency_us.taken, res.decode_gate)
        assert res.verified == 300, res.failure_reasons
        outs[name] = deterministic(tmp_path / name)
    load = res.decode_gate.load
    assert load.forward_steps_per_s_idle > 0 and load.forward_steps_per_s_serving > 0
    for part in ("requests", "decisions"):
        a, b = outs["reference"][part], outs[mode][part]
        assert a == b, [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k)][:5]
