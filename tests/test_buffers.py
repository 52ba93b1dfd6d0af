"""MetadataBuffers against SGLang's layout and request attribute names."""

from __future__ import annotations

import torch

from orchestrator import MetadataBuffers
from orchestrator.buffers import SlotAllocator
from orchestrator.config import MemPoolType, WorkloadConfig
from orchestrator.workload import make_request

SGLANG_FIELDS = [
    ("output_ids", 16, torch.int32), ("cached_tokens", 16, torch.int32),
    ("output_token_logprobs_val", 16, torch.float32), ("output_token_logprobs_idx", 16, torch.int32),
    ("output_top_logprobs_val", 128, torch.float32), ("output_top_logprobs_idx", 128, torch.int32),
    ("output_topk_p", 16, torch.float32), ("output_topk_index", 16, torch.int64),
    ("output_hidden_states", 16, torch.float32), ("bootstrap_room", 8, torch.uint64),
]


def test_layout_matches_sglang():
    b = MetadataBuffers(8, 16, torch.float32)
    assert [(s.name, s.width, s.dtype) for s in b.specs] == SGLANG_FIELDS
    for t, (_, width, dtype) in zip(b.fields, SGLANG_FIELDS):
        assert t.shape == (8, width) and t.dtype is dtype
    ptrs, lens, items = b.get_buf_infos()
    assert items == [w * d.itemsize for _, w, d in SGLANG_FIELDS]
    assert lens == [8 * i for i in items]
    assert b.row_bytes == 1600  # the note's number for hidden 16 float32
    assert all(p % 256 == 0 for p in ptrs)
    assert b.device.type == "cpu"


def test_dsa_field_sits_before_bootstrap_room():
    b = MetadataBuffers(4, 7168, torch.bfloat16, output_dsa_topk_indices_dim=32)
    names = [s.name for s in b.specs]
    assert names[-2:] == ["output_dsa_topk_indices", "bootstrap_room"]
    assert (b.output_dsa_topk_indices == -1).all()
    assert b.output_hidden_states.dtype is torch.bfloat16


def test_sglang_positional_constructor_and_custom_pool_means_host():
    b = MetadataBuffers(4, 16, torch.float16, 64, object(), 0)
    assert b.device.type == "cpu" and b.output_top_logprobs_val.shape == (4, 64)
    assert MetadataBuffers(2, 16, torch.float32, mem_pool=MemPoolType.NVLINK).device.type == "cpu"


def test_set_buf_reads_sglang_attributes_and_get_buf_round_trips():
    b = MetadataBuffers(4, 32, torch.float32)
    w = WorkloadConfig(top_logprobs_num=5)
    req = make_request(w, 3, 32)
    req.metadata_buffer_index = 2
    b.set_buf(req)
    row = b.get_buf(2)
    assert int(row[0][0]) == req.output_ids[0]
    assert row[1][:4].tolist() == [req.cached_tokens, req.cached_tokens_device,
                                   req.cached_tokens_host, req.cached_tokens_storage]
    assert torch.allclose(row[4][:5], torch.tensor(req.output_top_logprobs_val[0]))
    assert row[5][:5].tolist() == req.output_top_logprobs_idx[0]
    assert torch.equal(row[8], req.hidden_states_tensor)
    assert torch.equal(row[7], req.output_topk_index)
    assert int(row[-1][0]) == req.bootstrap_room
    # get_buf returns copies
    row[0][0] = -1
    assert int(b.output_ids[2, 0]) == req.output_ids[0]
    # other rows untouched
    assert b.row_checksum(1) == MetadataBuffers(4, 32, torch.float32).row_checksum(1)


def test_set_buf_without_logprobs_or_hidden_leaves_fields_zero():
    b = MetadataBuffers(2, 16, torch.float32)
    req = make_request(WorkloadConfig(return_logprob=False, hidden_states=False), 0, 16)
    req.metadata_buffer_index = 0
    req.bootstrap_room = None
    b.set_buf(req)
    assert b.room(0) == 0
    assert not b.output_top_logprobs_val[0].any() and not b.output_hidden_states[0].any()


def test_checksum_sees_every_byte():
    b = MetadataBuffers(2, 16, torch.float32)
    base = b.row_checksum(0)
    for field in b.fields:
        field.view(torch.uint8)[0, -1] ^= 1
        assert b.row_checksum(0) != base
        field.view(torch.uint8)[0, -1] ^= 1
    assert b.row_checksum(0) == base


def test_freeing_a_slot_zeroes_its_room():
    b = MetadataBuffers(2, 16, torch.float32)
    alloc = SlotAllocator(2)
    slot = alloc.alloc()
    b.bootstrap_room[slot, 0] = 1234
    b.clear_room(slot)
    alloc.free(slot)
    assert b.room(slot) == 0
    assert alloc.alloc() == slot  # LIFO: the freed row is the next one handed out


def test_workload_is_deterministic():
    w = WorkloadConfig(seed=7)
    a, c = make_request(w, 11, 64), make_request(w, 11, 64)
    assert a.bootstrap_room == c.bootstrap_room != 0
    assert torch.equal(a.hidden_states_tensor, c.hidden_states_tensor)
    assert make_request(w, 12, 64).bootstrap_room != a.bootstrap_room


def test_gathered_snapshot_equals_per_field_rows():
    """The device path (one index_select) reads exactly the bytes of the per-field path."""
    b = MetadataBuffers(5, 48, torch.bfloat16, output_dsa_topk_indices_dim=8)
    for t in b.fields:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    for slot in range(5):
        snap = b.row_snapshot(slot)
        assert snap == b._gathered_snapshot(slot)
        assert snap == b"".join(bytes(t[slot].view(torch.uint8).tolist()) for t in b.fields)
        assert b.snapshot_room(snap, b.room_offset) == b.room(slot)


def test_latency_histogram_percentiles_within_a_quarter_percent():
    import random

    from orchestrator.stats import LatencyHistogram, percentile

    rng = random.Random(3)
    values = [rng.lognormvariate(5, 1.2) for _ in range(20000)] + [0.01, 3e7]
    h = LatencyHistogram(values)
    for q in (1, 50, 90, 99, 99.9):
        exact = percentile(values, q)
        assert abs(h.percentile(q) - exact) / exact < 0.0026
    half = LatencyHistogram(values[:7000]).merge(LatencyHistogram(values[7000:]))
    assert half.summary() == h.summary() and half.n == len(values)
    assert LatencyHistogram.from_dict(h.to_dict()).summary() == h.summary()
    assert len(h.counts) < 4200  # bounded, whatever the number of samples
