"""Row digests, computed in batch where the rows live.

Every field's row of a slot (all but the kv_checksum field itself) is read as signed
little-endian 16-bit words x_1..x_n, and

    c_j = (sum_i x_i * w_ij) mod P            P = 16,777,213 (prime, < 2^24), j = 0..3

with weights w_ij in [1, 2^24). Each product is below 2^39 in size and 8,192 of them sum
below 2^52, so the sums are exact in float64: one matrix product on the rows' device (numpy
on the host, torch on CUDA) gives every column for a whole step; longer rows are summed in
8,192-word chunks. Changing any one byte changes one word by a nonzero amount below
2^16 < P, which changes every c_j: a single flipped byte is always caught.

The same product also returns the room's and the landed tag's words (one-hot weight
columns), so reading a step's rows costs one gather, one product and one small copy to the
host, whatever the number of rows.

Columns 0 and 1 use weights drawn from the run's secret and are masked with a pad that
depends on the secret and the request's identity (prefill rank, request id):

    tag = ((c_0 + pad_0) mod P) | ((c_1 + pad_1) mod P) << 24 | 1 << 62

Without the secret nobody can produce a row and tag the receiver accepts (a Wegman-Carter
authenticator: the pad hides the hash of each message, so rows read off the wire or out of
registered memory reveal nothing about the weights), and a row moved to another request's
slot carries the wrong pad. Columns 2 and 3 use public weights: they fingerprint the content
alone, identically in every run (requests.jsonl, replay).

The digest is linear, so with workload.fill=ahead (every row filled once before the timed
phase, a request writing only its room) the sender takes each slot's sums once on the device
(freeze) and adds its room's words on the host per request. The receiver always reads the
bytes that landed. verify.digest=blake2b computes a keyed blake2b per row on the host
instead (host rows only).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .buffers import MetadataBuffers
from .config import DigestKind

P = 16_777_213
CHUNK_WORDS = 8192
MARK = 1 << 62
# kv_checksum[slot, 1]: marks a digest of this tool's (an SGLang decode skips the comparison
# of digests whose signature differs from its own KV layout signature)
SIGNATURE = int.from_bytes(b"ORCHAUX1", "little") & ((1 << 63) - 1)
_PUBLIC_SEED = 0x5EED_0A0C
_U64 = (1 << 64) - 1


def _weights(seed: int, words: int, cols: int) -> np.ndarray:
    rng = np.random.Generator(np.random.Philox(seed))
    return rng.integers(1, 1 << 24, size=(words, cols), dtype=np.int64).astype(np.float64)


def pack_tag(c0: int, c1: int, pad: tuple[int, int]) -> int:
    return ((c0 + pad[0]) % P) | (((c1 + pad[1]) % P) << 24) | MARK


def _u64(words: Sequence[int]) -> int:
    """Four little-endian signed 16-bit words as the uint64 they spell."""
    return sum((int(w) & 0xFFFF) << (16 * i) for i, w in enumerate(words)) & _U64


def _split(value: int) -> list[int]:
    """The inverse of _u64: a uint64 as four signed 16-bit words."""
    out = []
    for i in range(4):
        w = (value >> (16 * i)) & 0xFFFF
        out.append(w - 0x10000 if w >= 0x8000 else w)
    return out


@dataclass(frozen=True)
class RowCheck:
    """What the receiver read of one slot: the keyed sums, the content fingerprint, the room
    and the tag that landed in the row (0 when the layout has no kv_checksum field)."""

    keyed: tuple[int, int]
    content: str
    room: int
    landed_tag: int


class Keys:
    """The secret-derived parts of the digest (weights seed, pad key). `nonce`, the prefill
    process's per-run nonce (orchestrator.auth), goes into the pad key: a row and tag from
    another run, even under the same secret, carries the wrong pad."""

    def __init__(self, secret: bytes, nonce: str = ""):
        h = hashlib.blake2b(secret, digest_size=32, person=b"orch-digest-v1")
        material = h.digest()
        self.weight_seed = int.from_bytes(material[:16], "little")
        self.pad_key = (hashlib.blake2b(nonce.encode(), key=material[16:], digest_size=16).digest()
                        if nonce else material[16:])

    def pad(self, rank: int, rid: int) -> tuple[int, int]:
        raw = hashlib.blake2b(struct.pack("<IQ", rank, rid), key=self.pad_key, digest_size=8).digest()
        return int.from_bytes(raw[:4], "little") % P, int.from_bytes(raw[4:], "little") % P


class RowDigest:
    """Digests of a batch of slots of one MetadataBuffers, on its device."""

    def __init__(self, buffers: MetadataBuffers, keys: Keys, kind: DigestKind = DigestKind.linear):
        self.b, self.keys, self.kind = buffers, keys, kind
        self.device = buffers.device
        self.frozen: Optional[np.ndarray] = None  # (slots, 4) sums without the room (fill=ahead)
        self.rank_keys: dict[int, Keys] = {}  # receiver: each prefill rank's run-bound keys
        if kind is DigestKind.blake2b:
            if self.device.type != "cpu":
                raise ValueError("verify.digest=blake2b reads rows on the host: host buffers only")
            return
        covered = [i for i in range(len(buffers.specs)) if i != buffers.checksum_field]
        base, step = [], []
        room_at = tag_at = None
        for i in covered + ([buffers.checksum_field] if buffers.checksum_field is not None else []):
            n = buffers.item_lens[i]
            assert n % 2 == 0 and buffers.offsets[i] % 2 == 0, "fields hold 16-bit words"
            if i == buffers.room_field:
                room_at = sum(len(b) for b in base)
            if i == buffers.checksum_field:
                tag_at = sum(len(b) for b in base)
            start = buffers.offsets[i] // 2
            base.append(np.arange(start, start + n // 2, dtype=np.int64))
            step.append(np.full(n // 2, n // 2, dtype=np.int64))
        self.base, self.step = np.concatenate(base), np.concatenate(step)
        n_idx = len(self.base)
        self.words = tag_at if tag_at is not None else n_idx  # the digested words come first
        weights = np.zeros((n_idx, 12), dtype=np.float64)
        weights[:self.words, :2] = _weights(keys.weight_seed, self.words, 2)
        weights[:self.words, 2:4] = _weights(_PUBLIC_SEED ^ self.words, self.words, 2)
        for j in range(4):  # one-hot columns: the room's words, and the landed tag's
            weights[room_at + j, 4 + j] = 1.0
            if tag_at is not None:
                weights[tag_at + j, 8 + j] = 1.0
        self.room_rows = weights[room_at:room_at + 4, :4].copy()  # for the frozen sums
        self.has_tag = tag_at is not None
        if self.device.type == "cpu":
            self._u16 = buffers.arena.numpy().view(np.int16)
            self._w = weights
        else:
            dev = self.device
            self._u16 = buffers.arena.view(torch.int16)
            self._w = torch.from_numpy(weights).to(dev)
            slots = torch.arange(buffers.size, dtype=torch.int64)
            self._table = (slots[:, None] * torch.from_numpy(self.step) + torch.from_numpy(self.base)).to(dev)

    # ---- the product ----------------------------------------------------------------------
    def _sums(self, slots: Sequence[int]) -> np.ndarray:
        """(k, 12) int64 host array: c_0..c_3 (not yet reduced mod P), the room's 4 words,
        the landed tag's 4 words."""
        slots = list(slots)
        k = len(slots)
        if self.device.type == "cpu":
            idx = np.asarray(slots, dtype=np.int64)[:, None] * self.step + self.base
            x = self._u16[idx]
            out = np.zeros((k, 12), dtype=np.int64)
            for lo in range(0, x.shape[1], CHUNK_WORDS):
                out += (x[:, lo:lo + CHUNK_WORDS].astype(np.float64) @ self._w[lo:lo + CHUNK_WORDS]).astype(np.int64)
            return out
        first = slots[0]
        if slots == list(range(first, first + k)):
            idx = self._table[first:first + k]  # a view: no index upload
        else:
            idx = self._table.index_select(0, torch.tensor(slots, dtype=torch.int64).to(self.device))
        x = self._u16[idx]
        n = x.shape[1]
        if n <= CHUNK_WORDS + 8:  # exact integers in float64: converted on the host
            return (x.to(torch.float64) @ self._w).cpu().numpy().astype(np.int64)
        out = sum((x[:, lo:lo + CHUNK_WORDS].to(torch.float64) @ self._w[lo:lo + CHUNK_WORDS]).to(torch.int64)
                  for lo in range(0, n, CHUNK_WORDS))
        return out.cpu().numpy()  # one small copy to the host

    def warm(self) -> None:
        """Passes over every batch shape a step can have (1, 2, 4, ... slots; consecutive and
        scattered) at start-up: on a GPU the first matmul of a shape loads its kernels, and
        the first creates the cuBLAS handle, tens of ms that the first measured steps would
        pay otherwise. Reads only."""
        if self.kind is DigestKind.blake2b or self.device.type == "cpu":
            return
        k = 1
        while True:
            k = min(k, self.b.size)
            self._sums(range(k))
            if k > 1:
                self._sums(list(range(k - 1, -1, -1)))  # not consecutive: the gathered path
            if k == self.b.size:
                break
            k *= 2

    # ---- sender ---------------------------------------------------------------------------
    def sign(self, slots: Sequence[int], idents: Sequence[tuple[int, int]],
             pads: Optional[Sequence[tuple[int, int]]] = None) -> tuple[list[int], list[str]]:
        """(tags, content fingerprints) of the rows in `slots`, whose requests are `idents`
        (prefill rank, request id). `pads` may be given when they were derived ahead."""
        pads = pads if pads is not None else [self.keys.pad(r, q) for r, q in idents]
        if self.kind is DigestKind.blake2b:
            out = [self._blake(slot, ident) for slot, ident in zip(slots, idents)]
            return [t for t, _ in out], [c for _, c in out]
        c = np.mod(self._sums(slots)[:, :4], P).tolist()
        return self._tags(c, pads)

    def freeze(self) -> None:
        """fill=ahead: every slot's sums without its room, taken once on the device."""
        if self.kind is DigestKind.blake2b:
            return
        sums = self._sums(range(self.b.size))
        rooms = sums[:, 4:8].astype(np.float64)
        self.frozen = np.mod(sums[:, :4] - (rooms @ self.room_rows).astype(np.int64), P)
        self._frozen_rows = self.frozen.tolist()  # Python ints: a step of a few rows is host arithmetic
        self._room_rows = self.room_rows.astype(np.int64).tolist()

    def sign_rooms(self, slots: Sequence[int], rooms: Sequence[int],
                   pads: Sequence[tuple[int, int]], idents: Sequence[tuple[int, int]]) -> tuple[list[int], list[str]]:
        """fill=ahead: the tags of frozen rows that now hold `rooms` (host arithmetic)."""
        if self.frozen is None:
            return self.sign(slots, idents, pads)
        frozen, rr = self._frozen_rows, self._room_rows
        c = []
        for slot, room in zip(slots, rooms):
            w = _split(room)
            c.append([(frozen[slot][j] + w[0] * rr[0][j] + w[1] * rr[1][j] + w[2] * rr[2][j]
                       + w[3] * rr[3][j]) % P for j in range(4)])
        return self._tags(c, pads)

    @staticmethod
    def _tags(c: list[list[int]], pads) -> tuple[list[int], list[str]]:
        tags = [pack_tag(row[0], row[1], pad) for row, pad in zip(c, pads)]
        return tags, [f"{row[2] | row[3] << 24:012x}" for row in c]

    # ---- receiver ---------------------------------------------------------------------------
    def read(self, slots: Sequence[int], idents: Sequence[tuple[int, int]]) -> list[RowCheck]:
        """What landed in `slots`: sums, content, room and tag, in one pass (one D2H)."""
        if self.kind is DigestKind.blake2b:
            out = []
            for slot, ident in zip(slots, idents):
                tag, content = self._blake(slot, ident)
                landed = self.b.get_kv_checksum(slot)[0] if self.b.checksum_field is not None else 0
                out.append(RowCheck((tag, 0), content, self.b.room(slot), landed))
            return out
        sums = self._sums(slots)
        c = np.mod(sums[:, :4], P).tolist()
        return [RowCheck((row[0], row[1]), f"{row[2] | row[3] << 24:012x}", _u64(s[4:8]),
                         _u64(s[8:12]) if self.has_tag else 0)
                for row, s in zip(c, sums.tolist())]

    def expected_tag(self, check: RowCheck, pad: tuple[int, int]) -> int:
        if self.kind is DigestKind.blake2b:
            return check.keyed[0]
        return pack_tag(check.keyed[0], check.keyed[1], pad)

    def _blake(self, slot: int, ident: tuple[int, int]) -> tuple[int, str]:
        skip = [self.b.checksum_field] if self.b.checksum_field is not None else []
        snap = self.b.row_snapshot(slot, skip=skip)
        keyed = hashlib.blake2b(snap, key=self.rank_keys.get(ident[0], self.keys).pad_key, digest_size=8,
                                person=struct.pack("<IQ", *ident)).digest()
        tag = (int.from_bytes(keyed, "little") & ((1 << 62) - 1)) | MARK
        return tag, hashlib.blake2b(snap, digest_size=6).hexdigest()
