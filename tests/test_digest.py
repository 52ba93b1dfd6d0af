"""The row digest: computed in batch on the rows' device, it catches ANY single flipped byte
in any field of any row, is keyed with the run's secret and bound to the request's identity.
(The same proof runs on CUDA rows in tests/test_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestrator import MetadataBuffers
from orchestrator.handoff.digest import MARK, Keys, P, RowDigest, _u64
from orchestrator.profile.config import DigestKind

SECRET = b"k" * 32


def _filled(device="cpu", size=6, hidden=24, dtype=torch.bfloat16, **kw):
    b = MetadataBuffers(size, hidden, dtype, 16, device=device, output_dsa_topk_indices_dim=4,
                        enable_sampling_mask=True, **kw)
    g = torch.Generator().manual_seed(1)
    for t in b.fields:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g).to(raw.device))
    return b


def flipped_byte_sweep(device: str) -> int:
    """Flip every byte of every field of every row, one at a time; each flip must change the
    tag of that row, and of that row only. Returns the number of flips checked."""
    b = _filled(device, kv_checksum_enabled=True)
    d = RowDigest(b, Keys(SECRET))
    slots = list(range(b.size))
    idents = [(0, 100 + s) for s in slots]
    base_tags, base_content = d.sign(slots, idents)
    checked = 0
    for f, t in enumerate(b.fields):
        if f == b.checksum_field:
            continue
        raw = t.view(torch.uint8)
        for slot in slots:
            for offset in range(raw.shape[1]):
                raw[slot, offset] ^= 0x01 << (offset % 8)
                tags, content = d.sign(slots, idents)
                raw[slot, offset] ^= 0x01 << (offset % 8)
                assert tags[slot] != base_tags[slot], (b.specs[f].name, slot, offset)
                assert content[slot] != base_content[slot]
                assert tags[:slot] + tags[slot + 1:] == base_tags[:slot] + base_tags[slot + 1:]
                checked += 1
    return checked


def test_any_single_flipped_byte_in_any_field_of_any_row_is_caught():
    assert flipped_byte_sweep("cpu") > 6 * 1000


def test_tag_is_keyed_and_bound_to_identity():
    b = _filled()
    slots = [0, 1, 2]
    idents = [(0, 7), (0, 8), (1, 7)]
    tags, content = RowDigest(b, Keys(SECRET)).sign(slots, idents)
    other, other_content = RowDigest(b, Keys(b"another secret")).sign(slots, idents)
    assert all(t & MARK for t in tags)
    assert all(a != c for a, c in zip(tags, other))  # another secret, other tags ...
    assert content == other_content  # ... but the public fingerprint is the content's alone
    moved, _ = RowDigest(b, Keys(SECRET)).sign(slots, [(0, 8), (0, 7), (0, 7)])
    assert moved[0] != tags[0] and moved[2] != tags[2]  # same bytes, another request: refused


def test_sender_and_receiver_agree():
    sender, receiver = _filled(kv_checksum_enabled=True), _filled(kv_checksum_enabled=True)
    s, r = RowDigest(sender, Keys(SECRET)), RowDigest(receiver, Keys(SECRET))
    slots, idents = [1, 4], [(3, 11), (3, 12)]
    tags, content = s.sign(slots, idents)
    sender.write_checksums(slots, tags, 99)
    for slot in slots:  # "transfer": copy the rows over
        for src, dst in zip(sender.fields, receiver.fields):
            dst[slot].copy_(src[slot])
    checks = r.read(slots, idents)
    keys = Keys(SECRET)
    for c, ident, tag, cont, slot in zip(checks, idents, tags, content, slots):
        assert c.landed_tag == tag and c.content == cont and c.room == receiver.room(slot)
        assert r.expected_tag(c, keys.pad(*ident)) == tag


@pytest.mark.parametrize("kw", [{}, {"kv_checksum_enabled": True}])
def test_a_steps_read_of_host_rows_is_what_the_rows_words_give_in_runs_or_scattered(kw):
    """_read_host gathers a step's rows a field at a time (a run of slots: a slice of each
    field): its sums, rooms and tags are those of each slot's words as the gather table
    places them, whatever the slots' order."""
    b = _filled(size=16, **kw)
    d = RowDigest(b, Keys(SECRET))
    w, room_at, tag_at = d._host_read
    for slots in ([3], list(range(2, 11)), [9, 0, 4, 4, 15], list(range(16)), [15, 14, 13]):
        got = d._read_host(slots)
        x = d._u16[d._idx[slots]]
        assert (got.c == np.mod((x[:, :d.words].astype(np.float64) @ w).astype(np.int64), P)).all()
        assert got.rooms.tolist() == [b.room(s) for s in slots]
        if tag_at is not None:
            assert got.tags.tolist() == [b.get_kv_checksum(s)[0] for s in slots]


def test_pads_of_a_run_are_each_requests_pad():
    keys = Keys(SECRET, "ab" * 16)
    assert keys.pads(3, [5, 6, 1 << 40]) == [keys.pad(3, 5), keys.pad(3, 6), keys.pad(3, 1 << 40)]


def test_long_rows_are_summed_in_chunks_exactly():
    b = _filled(hidden=20000, dtype=torch.float32)  # 80 KB of hidden state: 10 chunks
    d = RowDigest(b, Keys(SECRET))
    a, _ = d.sign([0, 1], [(0, 1), (0, 2)])
    b.output_hidden_states.view(torch.uint8)[1, 77777] ^= 0x80
    c, _ = d.sign([0, 1], [(0, 1), (0, 2)])
    assert a[0] == c[0] and a[1] != c[1]


def test_blake2b_digest_for_host_rows():
    b = _filled(kv_checksum_enabled=True)
    d = RowDigest(b, Keys(SECRET), DigestKind.blake2b)
    tags, content = d.sign([0, 1], [(0, 1), (0, 2)])
    b.output_ids.view(torch.uint8)[1, 3] ^= 1
    tags2, content2 = d.sign([0, 1], [(0, 1), (0, 2)])
    assert tags[0] == tags2[0] and tags[1] != tags2[1] and content[1] != content2[1]
    assert np.all([t & MARK for t in tags])


def test_blake2b_refused_for_device_rows():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ValueError):
        RowDigest(_filled("cuda"), Keys(SECRET), DigestKind.blake2b)


def test_frozen_rows_plus_room_equal_the_full_digest():
    b = _filled()
    d = RowDigest(b, Keys(SECRET))
    d.freeze()
    slots, rooms = [0, 3, 4], [5, (1 << 63) + 17, 123456789]
    idents = [(0, i) for i in range(3)]
    pads = [Keys(SECRET).pad(*i) for i in idents]
    b.write_rooms(slots, rooms)
    assert d.sign_rooms(slots, rooms, pads, idents) == d.sign(slots, idents, pads)


def test_frozen_rows_of_a_large_step_equal_the_full_digest():
    b = _filled(size=32)
    d = RowDigest(b, Keys(SECRET))
    d.freeze()
    slots, rooms = list(range(3, 19)), [(1 << 63) + 977 * i for i in range(16)]  # vectorized path
    idents = [(0, i) for i in range(16)]
    pads = [Keys(SECRET).pad(*i) for i in idents]
    b.write_rooms(slots, rooms)
    assert d.sign_rooms(slots, rooms, pads, idents) == d.sign(slots, idents, pads)


def test_a_large_steps_arrays_are_what_the_row_by_row_seal_writes():
    """The ahead seal of device rows writes a step of many from _frozen_step's arrays: the
    rooms' int64 view is _as_i64 of each (rooms at and past 2^63 too), the tags are the ones
    signed row by row (sign_rooms of each row alone) and the full digest gives."""
    from orchestrator.handoff.buffers import _as_i64

    b = _filled(size=40)
    d = RowDigest(b, Keys(SECRET))
    d.freeze()
    slots = [7, 8, 9, 30, 31, 2, 3, 4, 5, 39]
    rooms = [(1 << 63) + 977 * i if i % 2 else 1 + 31337 * i for i in range(len(slots))]
    idents = [(1, 500 + i) for i in range(len(slots))]
    pads = Keys(SECRET).pads(1, [i for _, i in idents])
    at, room, tags, contents = d._frozen_step(slots, rooms, pads)
    assert at.tolist() == slots and room.view(np.int64).tolist() == [_as_i64(r) for r in rooms]
    one = [d.sign_rooms([s], [r], [p], [i]) for s, r, p, i in zip(slots, rooms, pads, idents)]  # row by row
    assert tags.tolist() == [t[0][0] for t in one] and contents == [t[1][0] for t in one]
    b.write_rooms(slots, rooms)
    assert (tags.tolist(), contents) == d.sign(slots, idents, pads)


@pytest.mark.parametrize("hidden,kv_checksum", [(24, False), (24, True), (20000, True)])
def test_a_host_read_gives_what_the_device_reads_product_gives(hidden, kv_checksum):
    """Host rows read the room and the landed tag as they lie, not through the one-hot
    columns of the product (device rows): the same checks, short and chunked rows alike."""
    b = _filled(hidden=hidden, dtype=torch.float32, kv_checksum_enabled=kv_checksum)
    d = RowDigest(b, Keys(SECRET))
    b.write_rooms([2, 5], [(1 << 63) + 3, 77])
    if kv_checksum:
        b.write_checksums([2, 5], [MARK | 12345, MARK | (1 << 61)], 99)
    slots = [5, 0, 2]
    sums = d._sums(slots)  # the product every column comes from (device rows read it back)
    want = [(tuple(np.mod(s[:2], P).tolist()), f"{int(s[2]) % P | (int(s[3]) % P) << 24:012x}",
             _u64(s[4:8]), _u64(s[8:12]) if kv_checksum else 0) for s in sums.tolist()]
    got = d.read(slots, [(0, s) for s in slots])
    assert [(r.keyed, r.content, r.room, r.landed_tag) for r in got] == want
    assert got[2].room == (1 << 63) + 3 and got[0].room == 77 == b.room(5)
    if kv_checksum:
        assert got[0].landed_tag == MARK | (1 << 61) == b.get_kv_checksum(5)[0]


def test_a_reads_fold_gives_the_rooms_and_tags_words_spell():
    """A read's sums folded on the host in one cast and one view (_fold): the same
    values as the word-by-word formula for every row, rooms and tags with their top bit set
    and negative 16-bit words included."""
    from orchestrator.handoff.digest import _fold, _u64

    b = _filled(hidden=24, dtype=torch.float32, kv_checksum_enabled=True)
    d = RowDigest(b, Keys(SECRET))
    b.write_rooms([2, 5], [(1 << 63) + 3, 77])
    b.write_checksums([2, 5], [MARK | 12345, MARK | (1 << 61)], 99)
    sums = d._sums([5, 0, 2])
    sums[1, :4] = [-7, P + 3, 0, -P]  # signed sums: mod P as np.mod takes it
    sums[1, 4:8] = [-1, 0x7FFF, -32768, 5]
    got = _fold(sums, True)
    assert got.c.tolist() == np.mod(sums[:, :4], P).tolist()
    assert got.rooms.tolist() == [_u64(r[4:8]) for r in sums.tolist()]
    assert got.tags.tolist() == [_u64(r[8:12]) for r in sums.tolist()]
    assert int(got.rooms[2]) == (1 << 63) + 3 and int(got.tags[0]) == MARK | (1 << 61)
    assert _fold(sums, False).tags.tolist() == [0, 0, 0]


@pytest.mark.parametrize("kv_checksum", [False, True])
def test_slot_words_are_each_slots_room_and_checksum_rows(kv_checksum):
    """MetadataBuffers.slot_words: per slot, the seal's words first (room word 0, then
    kv_checksum words 0 and 1), then the rest of both rows: what words_at gives."""
    b = MetadataBuffers(8, 24, torch.float32, 16, kv_checksum_enabled=kv_checksum)
    room_n = b.item_lens[b.room_field] // 8
    for s in range(b.size):
        row = b.slot_words[s].tolist()
        want_room = b.words_at(b.room_field, [s], range(room_n)).tolist()
        if kv_checksum:
            ck = b.words_at(b.checksum_field, [s], range(b.item_lens[b.checksum_field] // 8)).tolist()
            assert row[:3] == [want_room[0], ck[0], ck[1]]
            assert sorted(row) == sorted(want_room + ck)
        else:
            assert row[0] == want_room[0] and sorted(row) == sorted(want_room)


def test_a_ring_slot_asks_the_device_only_for_a_step_not_landed(monkeypatch):
    """_Slot.reuse: a slot whose last step landed is reused with no CUDA call; a fill=ahead
    seal (no event) not landed waits for its stream; a seal whose outputs are read waits for
    its event, after its outputs are read."""
    import torch

    from orchestrator.handoff import digest as dg

    calls: list[str] = []

    class FakeEvent:
        def synchronize(self) -> None:
            calls.append("event")

    class FakeStream:
        def synchronize(self) -> None:
            calls.append("stream")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    slot = dg._Slot.__new__(dg._Slot)
    slot.event, slot.last = FakeEvent(), None
    dev = torch.device("cpu")

    slot.reuse(dev)  # never used
    assert calls == []
    ahead = dg.Sealed([1], ["a"])
    ahead.landed = True
    slot.last = ahead
    slot.reuse(dev)
    assert calls == [] and slot.last is None
    slot.last = dg.Sealed([1], ["a"])  # not landed, no event
    slot.reuse(dev)
    assert calls == ["stream"]
    calls.clear()
    read = dg.Sealed(tags=[7], contents=["b"], event=FakeEvent())  # outputs already read
    slot.last = read
    slot.reuse(dev)
    assert calls == ["event"]
    calls.clear()
    read.landed = True
    slot.last = read
    slot.reuse(dev)
    assert calls == []
