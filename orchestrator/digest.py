"""Row digests, computed in batch where the rows live.

Every field's row of a slot (all but the kv_checksum field itself) is read as little-endian
16-bit words x_1..x_n, and

    c_j = (sum_i x_i * w_ij) mod P            P = 16,777,213 (prime, < 2^24), j = 0..3

with weights w_ij in [1, 2^24). Each product is below 2^40 and a row of up to 8,192 words
sums below 2^53, so the sums are exact in float64 and one matrix product on the rows' device
(numpy on the host, torch on CUDA) gives every column for a whole step; longer rows are
summed in 8,192-word chunks. Changing any one byte changes one word by a nonzero amount
below 2^16 < P, which changes every c_j: a single flipped byte is always caught.

Columns 0 and 1 use weights drawn from the run's secret and are masked with a pad that
depends on the secret and the request's identity (prefill rank, request id):

    tag = ((c_0 + pad_0) mod P) | ((c_1 + pad_1) mod P) << 24 | 1 << 62

Without the secret nobody can produce a row and tag the receiver accepts (a Wegman-Carter
authenticator: the pad hides the hash of each message, so rows read off the wire or out of
registered memory reveal nothing about the weights), and a row moved to another request's
slot carries the wrong pad. Columns 2 and 3 use public weights: they fingerprint the content
alone, identically in every run (requests.jsonl, replay).

verify.digest=blake2b computes a keyed blake2b per row on the host instead (host rows only).
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
MASK24 = (1 << 24) - 1
# kv_checksum[slot, 1]: marks a digest of this tool's (an SGLang decode skips the comparison
# of digests whose signature differs from its own KV layout signature)
SIGNATURE = int.from_bytes(b"ORCHAUX1", "little") & ((1 << 63) - 1)
_PUBLIC_SEED = 0x5EED_0A0C


def _weights(seed: int, words: int, cols: int) -> np.ndarray:
    rng = np.random.Generator(np.random.Philox(seed))
    return rng.integers(1, 1 << 24, size=(words, cols), dtype=np.int64).astype(np.float64)


def pack_tag(c0: int, c1: int, pad: tuple[int, int]) -> int:
    return ((c0 + pad[0]) % P) | (((c1 + pad[1]) % P) << 24) | MARK


@dataclass(frozen=True)
class RowCheck:
    """What the receiver read of one slot: the keyed sums, the content fingerprint, the room
    and the tag that landed in the row (0 when the layout has no kv_checksum field)."""

    keyed: tuple[int, int]
    content: str
    room: int
    landed_tag: int


class Keys:
    """The secret-derived parts of the digest (weights seed, pad key)."""

    def __init__(self, secret: bytes):
        h = hashlib.blake2b(secret, digest_size=32, person=b"orch-digest-v1")
        material = h.digest()
        self.weight_seed = int.from_bytes(material[:16], "little")
        self.pad_key = material[16:]
        self.secret = secret

    def pad(self, rank: int, rid: int) -> tuple[int, int]:
        raw = hashlib.blake2b(struct.pack("<IQ", rank, rid), key=self.pad_key, digest_size=8).digest()
        return int.from_bytes(raw[:4], "little") % P, int.from_bytes(raw[4:], "little") % P


class RowDigest:
    """Digests of a batch of slots of one MetadataBuffers, on its device."""

    def __init__(self, buffers: MetadataBuffers, keys: Keys, kind: DigestKind = DigestKind.linear):
        self.b, self.keys, self.kind = buffers, keys, kind
        self.device = buffers.device
        self.covered = [i for i in range(len(buffers.specs)) if i != buffers.checksum_field]
        if kind is DigestKind.blake2b:
            if self.device.type != "cpu":
                raise ValueError("verify.digest=blake2b reads rows on the host: host buffers only")
            return
        base, step = [], []
        for i in self.covered:
            n = buffers.item_lens[i]
            assert n % 2 == 0 and buffers.offsets[i] % 2 == 0, "fields hold 16-bit words"
            start = buffers.offsets[i] // 2
            base.append(np.arange(start, start + n // 2, dtype=np.int64))
            step.append(np.full(n // 2, n // 2, dtype=np.int64))
        self.words = int(sum(len(b) for b in base))
        weights = np.concatenate([_weights(keys.weight_seed, self.words, 2),
                                  _weights(_PUBLIC_SEED ^ self.words, self.words, 2)], axis=1)
        base_np, step_np = np.concatenate(base), np.concatenate(step)
        room_off = buffers.offsets[buffers.room_field] // 8
        room_step = buffers.item_lens[buffers.room_field] // 8
        ck = buffers.checksum_field
        if self.device.type == "cpu":
            self._u16 = buffers.arena.numpy().view(np.uint16)
            self._i64 = buffers.arena.numpy().view(np.int64)
            self._base, self._step, self._w = base_np, step_np, weights
        else:
            dev = self.device
            self._u16 = buffers.arena.view(torch.int16)
            self._i64 = buffers.arena.view(torch.int64)
            self._base = torch.from_numpy(base_np).to(dev)
            self._step = torch.from_numpy(step_np).to(dev)
            self._w = torch.from_numpy(weights).to(dev)
        self._room = (room_off, room_step)
        self._ck = (buffers.offsets[ck] // 8, buffers.item_lens[ck] // 8) if ck is not None else None

    # ---- the sums -----------------------------------------------------------------------
    def _sums(self, slots: Sequence[int]) -> np.ndarray:
        """(k, 6) int64 host array: c_0..c_3, room, landed tag (0 without kv_checksum)."""
        k = len(slots)
        if self.device.type == "cpu":
            s = np.asarray(slots, dtype=np.int64)
            idx = s[:, None] * self._step + self._base
            x = self._u16[idx]
            c = np.zeros((k, 4), dtype=np.int64)
            for lo in range(0, self.words, CHUNK_WORDS):
                part = x[:, lo:lo + CHUNK_WORDS].astype(np.float64) @ self._w[lo:lo + CHUNK_WORDS]
                c = (c + part.astype(np.int64)) % P
            room = self._i64[self._room[0] + s * self._room[1]]
            tag = self._i64[self._ck[0] + s * self._ck[1]] if self._ck else np.zeros(k, np.int64)
            return np.concatenate([c, room[:, None], tag[:, None]], axis=1)
        s = torch.tensor(list(slots), dtype=torch.int64).to(self.device, non_blocking=True)
        idx = s[:, None] * self._step + self._base
        x = self._u16[idx]
        c = torch.zeros((k, 4), dtype=torch.int64, device=self.device)
        for lo in range(0, self.words, CHUNK_WORDS):
            xs = x[:, lo:lo + CHUNK_WORDS].to(torch.int32).bitwise_and_(0xFFFF).to(torch.float64)
            c = (c + (xs @ self._w[lo:lo + CHUNK_WORDS]).to(torch.int64)) % P
        room = self._i64[self._room[0] + s * self._room[1]]
        tag = (self._i64[self._ck[0] + s * self._ck[1]] if self._ck
               else torch.zeros(k, dtype=torch.int64, device=self.device))
        return torch.cat([c, room[:, None], tag[:, None]], dim=1).cpu().numpy()  # one D2H

    # ---- sender --------------------------------------------------------------------------
    def sign(self, slots: Sequence[int], idents: Sequence[tuple[int, int]],
             pads: Optional[Sequence[tuple[int, int]]] = None) -> tuple[list[int], list[str]]:
        """(tags, content fingerprints) of `slots`, whose requests are `idents` (prefill
        rank, request id). `pads` may be given when they were derived ahead of time."""
        pads = pads if pads is not None else [self.keys.pad(r, q) for r, q in idents]
        if self.kind is DigestKind.blake2b:
            out = [self._blake(slot, ident) for slot, ident in zip(slots, idents)]
            return [t for t, _ in out], [c for _, c in out]
        sums = self._sums(slots).tolist()
        tags = [pack_tag(row[0], row[1], pad) for row, pad in zip(sums, pads)]
        return tags, [f"{row[2] | row[3] << 24:012x}" for row in sums]

    # ---- receiver ------------------------------------------------------------------------
    def read(self, slots: Sequence[int], idents: Sequence[tuple[int, int]]) -> list[RowCheck]:
        """What landed in `slots`: sums, content, room and tag, in one pass (one D2H)."""
        if self.kind is DigestKind.blake2b:
            out = []
            for slot, ident in zip(slots, idents):
                tag, content = self._blake(slot, ident)
                landed = self.b.get_kv_checksum(slot)[0] if self.b.checksum_field is not None else 0
                out.append(RowCheck((tag, 0), content, self.b.room(slot), landed))
            return out
        sums = self._sums(slots).tolist()
        return [RowCheck((row[0], row[1]), f"{row[2] | row[3] << 24:012x}", row[4] & ((1 << 64) - 1),
                         row[5] & ((1 << 64) - 1)) for row in sums]

    def expected_tag(self, check: RowCheck, pad: tuple[int, int]) -> int:
        if self.kind is DigestKind.blake2b:
            return check.keyed[0]
        return pack_tag(check.keyed[0], check.keyed[1], pad)

    def _blake(self, slot: int, ident: tuple[int, int]) -> tuple[int, str]:
        snap = self.b.row_snapshot(slot, skip=[self.b.checksum_field] if self.b.checksum_field is not None else ())
        keyed = hashlib.blake2b(snap, key=self.keys.pad_key, digest_size=8,
                                person=struct.pack("<IQ", *ident)).digest()
        tag = (int.from_bytes(keyed, "little") & ((1 << 62) - 1)) | MARK
        return tag, hashlib.blake2b(snap, digest_size=6).hexdigest()
