"""MetadataBuffers against SGLang 0.5.23's layout and API, and the slot allocator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestrator import MetadataBuffers
from orchestrator.handoff.buffers import SlotAllocator
from orchestrator.handoff.workload import Shapes, make_request, request_room, request_rooms, room_for, room_of
from orchestrator.profile.config import MemPoolType, WorkloadConfig
from orchestrator.profile.layout import load_layout

SGLANG_FIELDS = [
    ("output_ids", 16, torch.int32), ("cached_tokens", 16, torch.int32),
    ("output_token_logprobs_val", 16, torch.float32), ("output_token_logprobs_idx", 16, torch.int32),
    ("output_top_logprobs_val", 128, torch.float32), ("output_top_logprobs_idx", 128, torch.int32),
    ("output_topk_p", 16, torch.float32), ("output_topk_index", 16, torch.int64),
    ("output_hidden_states", 16, torch.float32), ("bootstrap_room", 8, torch.uint64),
]


def test_default_layout_matches_sglang():
    b = MetadataBuffers(8, 16, torch.float32, 256)
    assert [(s.name, s.width, s.dtype) for s in b.specs] == SGLANG_FIELDS
    for t, (_, width, dtype) in zip(b.fields, SGLANG_FIELDS):
        assert t.shape == (8, width) and t.dtype is dtype
    ptrs, lens, items = b.get_buf_infos()
    assert items == [w * d.itemsize for _, w, d in SGLANG_FIELDS]
    assert lens == [8 * i for i in items]
    assert b.row_bytes == 1600  # the note's number for hidden 16 float32
    assert all(p % 256 == 0 for p in ptrs)
    assert b.device.type == "cpu"
    assert b.output_dsa_topk_indices is None and b.kv_checksum is None
    assert b.output_token_sampling_mask_len is None


def test_optional_fields_sit_where_sglang_puts_them():
    b = MetadataBuffers(4, 7168, torch.bfloat16, 64, output_dsa_topk_indices_dim=32,
                        kv_checksum_enabled=True, enable_sampling_mask=True)
    names = [s.name for s in b.specs]
    assert names[6:9] == ["output_token_sampling_mask_len", "output_token_sampling_mask_idx",
                          "output_token_sampling_logprobs"]
    assert names[-3:] == ["output_dsa_topk_indices", "bootstrap_room", "kv_checksum"]
    assert b.output_token_sampling_mask_idx.shape == (4, 64)
    assert (b.output_dsa_topk_indices == -1).all()
    assert b.kv_checksum.shape == (4, 8) and b.kv_checksum.dtype is torch.uint64
    assert len(b.get_buf(0)) == 14 and b.get_buf(0)[12] is not None


def test_sglang_positional_constructor_and_custom_pool_means_host():
    b = MetadataBuffers(4, 16, torch.float16, 32, 64, object(), 0)
    assert b.device.type == "cpu" and b.output_top_logprobs_val.shape == (4, 64)
    assert MetadataBuffers(2, 16, torch.float32, 8, mem_pool=MemPoolType.NVLINK).device.type == "cpu"
    # the 4th positional argument is max_sampling_mask_tokens, not max_top_logprobs_num
    assert MetadataBuffers(64, 16, torch.float32, 4096).output_top_logprobs_val.shape == (64, 128)
    for attr in ("custom_mem_pool", "enable_sampling_mask", "kv_checksum",
                 "output_dsa_topk_indices", "output_dsa_topk_indices_dim"):
        assert hasattr(b, attr)


def test_get_buf_is_a_14_tuple_with_none_for_absent_fields():
    b = MetadataBuffers(2, 16, torch.float32, 8)
    row = b.get_buf(1)
    assert len(row) == 14
    assert [i for i, x in enumerate(row) if x is None] == [6, 7, 8, 12]


def _req(w=None, index=3, hidden=32, slot=2, dsa=0, **kw):
    w = w or WorkloadConfig(top_logprobs_num=5, **kw)
    req = make_request(w, index, Shapes(hidden, dsa_dim=dsa))
    req.metadata_buffer_index = slot
    return req


def test_set_buf_follows_sglang_0_5_23():
    b = MetadataBuffers(4, 32, torch.float32, 64)
    req = _req(multimodal=True)
    b.set_buf(req)
    row = b.get_buf(2)
    assert int(row[0][0]) == req.output_ids[0]
    assert row[1][:7].tolist() == [req.cached_tokens, req.cached_tokens_device, req.cached_tokens_host,
                                   req.cached_tokens_storage, *req.get_mm_token_counts()]
    assert any(req.get_mm_token_counts())
    assert torch.allclose(row[4][:5], torch.tensor(req.logprob.output_top_logprobs_val[0]))
    assert row[5][:5].tolist() == req.logprob.output_top_logprobs_idx[0]
    assert torch.equal(row[11], req.hidden_states_tensor)
    assert torch.equal(row[10], req.output_topk_index)
    assert int(row[13][0]) == req.bootstrap_room
    row[0][0] = -1  # get_buf returns copies
    assert int(b.output_ids[2, 0]) == req.output_ids[0]


def test_set_buf_refuses_more_top_logprobs_than_the_row_holds():
    b = MetadataBuffers(4, 32, torch.float32, 64, max_top_logprobs_num=4)
    with pytest.raises(RuntimeError, match="exceeds disaggregation metadata capacity"):
        b.set_buf(_req())


def test_dsa_row_only_with_hidden_state_and_minus_one_when_missing():
    b = MetadataBuffers(4, 32, torch.float32, 64, output_dsa_topk_indices_dim=8)
    b.output_dsa_topk_indices[2].fill_(7)  # a previous tenant's values
    req = _req(dsa=8)
    req.output_dsa_topk_indices = None
    b.set_buf(req)
    assert (b.output_dsa_topk_indices[2] == -1).all()
    b.output_dsa_topk_indices[2].fill_(7)
    b.set_buf(_req(hidden_states=False))  # no hidden state: the DSA row is not touched
    assert (b.output_dsa_topk_indices[2] == 7).all()


def test_sampling_mask_rows_are_written():
    b = MetadataBuffers(4, 32, torch.float32, 64, enable_sampling_mask=True)
    req = _req(WorkloadConfig(sampling_mask=True), slot=1)
    b.set_buf(req)
    chunk = req.sampling_mask_rows.view()
    n = len(chunk.token_ids)
    assert int(b.output_token_sampling_mask_len[1, 0]) == n
    assert b.output_token_sampling_mask_idx[1, :n].tolist() == chunk.token_ids.tolist()
    assert np.allclose(b.output_token_sampling_logprobs[1, :n].numpy(), chunk.logprobs)


def test_set_buf_without_logprobs_or_hidden_leaves_fields_zero():
    b = MetadataBuffers(2, 16, torch.float32, 8)
    req = _req(WorkloadConfig(return_logprob=False, hidden_states=False), slot=0, hidden=16)
    req.bootstrap_room = None
    b.set_buf(req)
    assert b.room(0) == 0
    assert not b.output_top_logprobs_val[0].any() and not b.output_hidden_states[0].any()


def test_kv_checksum_api_and_clear_slot():
    b = MetadataBuffers(4, 16, torch.float32, 8, kv_checksum_enabled=True)
    req = _req(slot=3, hidden=16)
    b.set_buf(req)
    assert b.get_kv_checksum(3) == (0, 0)
    b.set_kv_checksum(req, (1 << 63) - 5, 77)
    assert b.get_kv_checksum(3) == ((1 << 63) - 5, 77)
    with pytest.raises(ValueError):  # as SGLang's uint64 item assignment does
        b.set_kv_checksum(req, 1 << 63, 77)
    b.clear_slot(3)
    assert b.get_kv_checksum(3) == (0, 0) and b.room(3) == 0


def test_rooms_are_64_bit_unsigned():
    b = MetadataBuffers(2, 16, torch.float32, 8)
    b.write_rooms([1], [(1 << 64) - 2])
    assert b.room(1) == (1 << 64) - 2
    b.clear_slots([1])
    assert b.room(1) == 0


def test_older_layout_builds_too():
    old = load_layout("sglang_pre_0_5_23")
    b = MetadataBuffers(2, 16, torch.float32, 8, layout=old, kv_checksum_enabled=True,
                        enable_sampling_mask=True)  # the old release has neither field
    assert [s.name for s in b.specs] == [n for n, _, _ in SGLANG_FIELDS]
    assert len(b.get_buf(0)) == 11


def test_slot_allocator_hands_out_random_slots_and_consecutive_runs():
    a = SlotAllocator(64)
    first = [a.alloc() for _ in range(8)]
    assert len(set(first)) == 8 and first != sorted(first)  # not the lowest free ones in order
    anywhere = SlotAllocator(64).alloc_run(16)  # a run at a random place
    assert anywhere == list(range(anywhere[0], anywhere[0] + 16))
    b = SlotAllocator(64)
    run = b.alloc_run(16, start=8)  # placed, so the next run surely fits behind it
    assert run == list(range(8, 24))
    nxt = b.alloc_run(4, start=run[-1] + 1)
    assert nxt == list(range(run[-1] + 1, run[-1] + 5))
    for s in run:
        b.free(s)
    with pytest.raises(ValueError):
        b.free(run[0])
    assert b.available == 60


def test_rooms_depend_on_the_seed_and_repeat_as_asked():
    assert room_for(0, 5) != room_for(1, 5) and room_for(0, 5) != room_for(0, 6)
    assert room_for((1 << 63) - 1, 0) > 0
    w = WorkloadConfig(duplicate_rooms=2)
    assert room_of(w, 10) == room_of(w, 11) != room_of(w, 12)
    rids = [0, 1, 10, 11, 12, 1 << 40]
    for seed, dup in ((0, 1), (7, 2), ((1 << 63) - 1, 3)):  # a pass's rooms at once: each one's
        assert request_rooms(seed, dup, rids) == [request_room(seed, dup, rid) for rid in rids]


def test_workload_is_deterministic():
    w = WorkloadConfig(seed=7)
    a, c = make_request(w, 11, Shapes(64)), make_request(w, 11, Shapes(64))
    assert a.bootstrap_room == c.bootstrap_room != 0
    assert torch.equal(a.hidden_states_tensor, c.hidden_states_tensor)
    assert make_request(w, 12, Shapes(64)).bootstrap_room != a.bootstrap_room


def test_latency_histogram_percentiles_within_a_quarter_percent():
    import random

    from orchestrator.results.stats import LatencyHistogram, percentile

    rng = random.Random(3)
    values = [rng.lognormvariate(5, 1.2) for _ in range(20000)] + [0.01, 3e7]
    h = LatencyHistogram(values)
    for q in (1, 50, 90, 99, 99.9):
        exact = percentile(values, q)
        assert abs(h.percentile(q) - exact) / exact < 0.0026
    half = LatencyHistogram(values[:7000]).merge(LatencyHistogram(values[7000:]))
    assert half.summary() == h.summary() and half.n == len(values)
    assert len(h.counts) < 4200  # bounded, whatever the number of samples


def test_warm_up_scratch_lies_inside_the_registration_and_outside_every_field():
    from orchestrator.handoff.buffers import WARM_BYTES

    b = MetadataBuffers(8, 16, torch.float32, 256)
    ptrs, lens, _ = b.get_buf_infos()
    lo, hi = b.scratch_ptr, b.scratch_ptr + WARM_BYTES
    assert b.arena_ptr <= lo and hi == b.arena_ptr + b.arena_bytes  # registered with the fields
    assert all(p + n <= lo for p, n in zip(ptrs, lens))  # no field reaches into it
    assert hi <= b._arena.data_ptr() + b._arena.numel()  # inside the allocation


def test_staged_rows_pack_the_rows_set_buf_wrote_and_words_address_rooms():
    from orchestrator.handoff.buffers import StagedRows

    b = MetadataBuffers(8, 16, torch.float32, 16, output_dsa_topk_indices_dim=4, kv_checksum_enabled=True)
    staged = StagedRows(b)
    w = WorkloadConfig()
    shapes = Shapes(16, torch.float32, 4, 16)
    for slot in (5, 2):
        req = make_request(w, slot, shapes)
        req.metadata_buffer_index = slot
        staged.set_buf(req)
    out = np.zeros((2, b.row_bytes), dtype=np.uint8)
    staged.pack([5, 2], out)
    assert bytes(out[0]) == staged.rows.row_snapshot(5) and bytes(out[1]) == staged.rows.row_snapshot(2)
    # words_at: the flat int64 view addresses each slot's room and kv_checksum columns
    b.write_rooms([3], [(1 << 64) - 9], [12345], 77)
    assert b.room(3) == (1 << 64) - 9 and b.get_kv_checksum(3) == (12345, 77)
    assert int(b.words[b.words_at(b.room_field, [3])[0]]) == -9
    assert b.words_at(b.checksum_field, [3], (0, 1)).tolist() == [
        b.words_at(b.checksum_field, [3])[0], b.words_at(b.checksum_field, [3])[0] + 1]


def test_slot_runs_follow_every_take_and_free():
    """SlotAllocator.runs (found with bytes.find on its free mask) is the free runs a pass over
    every slot finds, after any mix of alloc, alloc_run (from a start or not), free and
    free_many; alloc_run from a free start takes the free slots from there, up to n."""
    import random

    rng = random.Random(5)
    a = SlotAllocator(64, random.Random(1))
    held: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            start = rng.choice([None, rng.randrange(64)])
            free_from = start is not None and start in a._free
            got = a.alloc_run(rng.randint(1, 20), start)
            assert got == list(range(got[0], got[0] + len(got))) if got else True
            if free_from:
                assert got[0] == start
            held += got
        elif op < 0.5 and (s := a.alloc()) is not None:
            held.append(s)
        elif held and op < 0.75:
            a.free(held.pop(rng.randrange(len(held))))
        elif held:
            batch = [held.pop(rng.randrange(len(held))) for _ in range(min(len(held), 5))]
            a.free_many(batch)
        free = set(a._free)
        want, first = [], None
        for s in range(65):
            if s < 64 and s in free and first is None:
                first = s
            elif not (s < 64 and s in free) and first is not None:
                want.append((first, s - first))
                first = None
        assert a.runs() == want and a.available == 64 - len(held)
    with pytest.raises(ValueError):
        a.free_many([held[0], held[0]] if held else [0, 0])
