"""Row digests, computed in batch where the rows live.

Every field's row of a slot (all but the kv_checksum field itself) is read as signed
little-endian 16-bit words x_1..x_n, and

    c_j = (sum_i x_i * w_ij) mod P            P = 16,777,213 (prime, < 2^24), j = 0..3

with weights w_ij in [1, 2^24). Each product is below 2^39 in size and 8,192 of them sum
below 2^52, so the sums are exact in float64: one matrix product on the rows' device (numpy
on the host, torch on CUDA) gives every column for a whole step; longer rows are summed in
8,192-word chunks. Changing any one byte changes one word by a nonzero amount below
2^16 < P, which changes every c_j: a single flipped byte is always caught.

On device rows the same product also returns the room's and the landed tag's words (one-hot
weight columns), so reading a step's rows costs one gather, one product and one small copy to
the host, whatever the number of rows; host rows take those words from the gathered rows as
they lie.

Columns 0 and 1 use weights drawn from the run's secret and are masked with a pad that
depends on the secret and the request's identity (prefill rank, request id):

    tag = ((c_0 + pad_0) mod P) | ((c_1 + pad_1) mod P) << 24 | 1 << 62

Without the secret nobody can produce a row and tag the receiver accepts (a Wegman-Carter
authenticator: the pad hides the hash of each message, so rows read off the wire or out of
registered memory reveal nothing about the weights), and a row moved to another request's
slot carries the wrong pad. Columns 2 and 3 use public weights: they fingerprint the content
alone, identically in every run (requests.jsonl, replay).

The digest is linear, so on host rows with workload.fill=ahead (every row filled once before
the timed phase, a request writing only its room) the sender takes each slot's sums once
(freeze) and adds its room's words per request. The receiver always reads the bytes that
landed. verify.digest=blake2b computes a keyed blake2b per row on the host instead (host
rows only).

On device rows a step's work is fixed-shape, so it is captured once per batch-size bucket
(1, 2, 4, ... slots) as a CUDA graph at start-up and replayed per step, its inputs staged
in pinned memory (a step padded to its bucket repeats its first entry, which writes the
same bytes again or reads them again):
  - the sender's seal: upload (slots, room positions, rooms, pads), [buffers.set_buf=staged:
    the step's packed rows, scattered to their slots], the rooms written, the digest taken,
    the tags computed and written into kv_checksum, tags and fingerprints copied back;
  - the receiver's read: upload the slots (and the freed slots' room and tag words, which
    it zeroes first: the bucket holds both), gather, digest, copy back.
Nothing in either waits: the caller's one wait per step covers it (a stream sync, or on the
sender the engine's own ordering; see orchestrator.handoff.endpoints.prefill).
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from orchestrator.handoff.buffers import _U64, MetadataBuffers, StagedRows, _as_i64
from orchestrator.profile.kinds import DigestKind

P = 16_777_213
CHUNK_WORDS = 8192
MARK = 1 << 62
_IDENT = struct.Struct("<IQ")  # (prefill rank, request id): what a pad is keyed on
_HALVES = struct.Struct("<II")  # a pad's 8 bytes: its two little-endian halves
# kv_checksum[slot, 1]: marks a digest of this tool's (an SGLang decode skips the comparison
# of digests whose signature differs from its own KV layout signature)
SIGNATURE = int.from_bytes(b"ORCHAUX1", "little") & ((1 << 63) - 1)
_PUBLIC_SEED = 0x5EED_0A0C
_TAKE_MOST = 4  # host rows: a read of up to this many slots gathers them in one take


def buckets(n: int) -> list[int]:
    """Batch-size buckets up to n slots: 1, 2, 4, ..., the first power of two >= n."""
    out = [1]
    while out[-1] < n:
        out.append(out[-1] * 2)
    return out


def bucket_of(k: int, sizes: Iterable[int]) -> int:
    """The first of `sizes` (ascending) that holds k."""
    return next(b for b in sizes if b >= k)


_CAPTURE_STREAMS: dict = {}


def _capture_stream() -> "torch.cuda.Stream":
    """The stream the digest's graphs are captured on: one of its own per device, never
    `torch.cuda.graph`'s shared default. cuBLAS bakes the workspace of the capturing stream
    into a graph, so two graphs captured on one stream share it: replayed at the same time on
    two streams (gate.read=side_stream beside a forward's graph) their GEMMs race on it and the
    GPU hangs (seen on an H200: a stream sync that never returned, the GPU at 100%). A
    high-priority pool stream is never the default capture stream (a low-priority one)."""
    dev = torch.cuda.current_device()
    if dev not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[dev] = torch.cuda.Stream(priority=-1)
    return _CAPTURE_STREAMS[dev]


def _capture(body: Callable[[], None]) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of body() (run twice on a side stream first, as capture requires); the
    graph keeps body(), and with it every tensor the replays read or write."""
    side = _capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        body()
    torch.cuda.current_stream().synchronize()
    # The graph replays into the addresses of every tensor body() holds (its device inputs,
    # constants, staged rows): they must live as long as the graph. Dropped with the closure,
    # their memory went back to the allocator, and the next tensors allocated (the request
    # pool's hidden states) were overwritten by every replay.
    graph.keep = body  # type: ignore[attr-defined]
    return graph


class Sealed:
    """A sealed step's tags and fingerprints: ready at once on host rows; on device rows
    once the step's device work ran (result() waits on its event; once the rows were sent it
    is long done)."""

    def __init__(self, tags: Optional[list[int]] = None, contents: Optional[list[str]] = None,
                 out: Optional[np.ndarray] = None, k: int = 0, event: Optional["torch.cuda.Event"] = None,
                 pack_s: float = 0.0) -> None:
        self._tags, self._contents, self._out, self._k, self._event = tags, contents, out, k, event
        self.pack_s = pack_s  # seconds spent packing staged rows (buffers.set_buf=staged)
        self._lock = threading.Lock() if tags is None else None
        # the send path sets it once every send of the step landed: the device work that sealed
        # its rows ran (the engine orders its writes after it, or the loop synced first)
        self.landed = False

    @property
    def ready(self) -> bool:
        return self._tags is not None

    @property
    def recorded(self) -> bool:
        """Whether an event marks the device work that sealed it (a seal whose outputs are read)."""
        return self._event is not None

    def result(self) -> tuple[list[int], list[str]]:
        """(tags, fingerprints); the scheduler and the transfer thread may both ask."""
        if self._tags is None:
            lock, event, out_all = self._lock, self._event, self._out
            assert lock is not None and event is not None and out_all is not None  # a device step's
            with lock:
                if self._tags is None:
                    event.synchronize()
                    out = out_all[:self._k]
                    self._contents = [f"{c:012x}" for c in out[:, 1].tolist()]
                    self._tags = out[:, 0].tolist()
        assert self._tags is not None and self._contents is not None  # set above, or given
        return self._tags, self._contents


RING = 4  # graph instances per bucket: the scheduler may run that many steps ahead of the device


class _Ring:
    """Instances of one captured graph, used in turn, so that a step rarely has to wait for
    the device to finish an earlier step before it can reuse pinned buffers."""

    __slots__ = ("items", "i")

    def __init__(self, items: list):
        self.items, self.i = items, 0

    def next(self) -> Any:
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


class _Slot:
    """One captured graph's pinned buffers are rewritten only after its last replay ran and
    what it returned was read (normally long before: this does not block). Where the step it
    sealed has landed (Sealed.landed) that is known without asking the device: in a loop
    that runs a large code path between two seals, every CUDA call costs several times its
    cost back to back (BENCHMARKS.md, session 50), so the seal makes as few as it can."""

    __slots__ = ("event", "last")

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.last: Optional[Sealed] = None

    def reuse(self, device: torch.device) -> None:
        last, self.last = self.last, None
        if last is None or last.landed:  # (landed: its tags and fingerprints were read before its send)
            return
        if last.recorded:
            last.result()  # reads the pinned outputs (after the event) before they change
            self.event.synchronize()
        else:  # a fill=ahead seal records no event: its stream is waited for
            torch.cuda.current_stream(device).synchronize()


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


def _fold(sums: np.ndarray, has_tag: bool) -> "StepRead":
    """A read's (k, 12) sums as a StepRead: the four sums mod P, the room's and the landed
    tag's words as the uint64 they spell (one cast and one view for both)."""
    words = sums[:, 4:12].astype(np.uint16).view(np.uint64)  # (k, 2): room, tag
    return StepRead(np.mod(sums[:, :4], P), words[:, 0], words[:, 1] if has_tag else np.zeros(len(sums), np.uint64))


def _row_check(c: list[int], room: int, tag: int) -> RowCheck:
    """One read row's RowCheck from its four sums (keyed pair, then the content's two)."""
    return RowCheck((c[0], c[1]), f"{c[2] | c[3] << 24:012x}", room, tag)


class StepRead:
    """What one read pass found, as arrays, row i for the i-th slot read: `c` the four sums
    mod P (keyed, then content; blake2b: the keyed tag, then 0), `rooms` and the landed `tags`
    (uint64; 0 when the layout has no kv_checksum field). A request's RowCheck is built only
    when asked for (the rows a step does not take in bulk)."""

    __slots__ = ("c", "rooms", "tags", "_checks", "blake")

    def __init__(self, c: np.ndarray, rooms: np.ndarray, tags: np.ndarray,
                 checks: Optional[list[RowCheck]] = None):
        self.c, self.rooms, self.tags = c, rooms, tags
        self._checks = checks
        self.blake = checks is not None  # the keyed column is the tag itself (no pad)

    @classmethod
    def of_checks(cls, checks: list[RowCheck]) -> "StepRead":
        k = len(checks)
        c = np.zeros((k, 4), dtype=np.int64)
        c[:, 0] = [r.keyed[0] for r in checks]
        return cls(c, np.array([r.room for r in checks], dtype=np.uint64).reshape(k),
                   np.array([r.landed_tag for r in checks], dtype=np.uint64).reshape(k), checks)

    def __len__(self) -> int:
        return len(self.rooms)

    def check(self, i: int) -> RowCheck:
        if self._checks is not None:
            return self._checks[i]
        return _row_check(self.c[i].tolist(), int(self.rooms[i]), int(self.tags[i]))

    def checks(self) -> list[RowCheck]:
        if self._checks is not None:
            return self._checks
        return [_row_check(row, room, tag)
                for row, room, tag in zip(self.c.tolist(), self.rooms.tolist(), self.tags.tolist())]

    def expected_tags(self, pad0: np.ndarray, pad1: np.ndarray) -> np.ndarray:
        """pack_tag over rows (uint64): the tag each row's sums give under its pads."""
        if self.blake:
            return self.c[:, 0].astype(np.uint64)
        return (np.mod(self.c[:, 0] + pad0, P) | (np.mod(self.c[:, 1] + pad1, P) << 24) | MARK).astype(np.uint64)


class Keys:
    """The secret-derived parts of the digest (weights seed, pad key). `nonce`, the prefill
    process's per-run nonce (orchestrator.handoff.transport.auth), goes into the pad key: a row and tag from
    another run, even under the same secret, carries the wrong pad."""

    def __init__(self, secret: bytes, nonce: str = ""):
        h = hashlib.blake2b(secret, digest_size=32, person=b"orch-digest-v1")
        material = h.digest()
        self.weight_seed = int.from_bytes(material[:16], "little")
        self.pad_key = (hashlib.blake2b(nonce.encode(), key=material[16:], digest_size=16).digest()
                        if nonce else material[16:])
        self._padder = hashlib.blake2b(key=self.pad_key, digest_size=8)  # keyed once; a pad copies it

    def pad(self, rank: int, rid: int) -> tuple[int, int]:
        return self.pads(rank, (rid,))[0]

    def pads(self, rank: int, rids: Iterable[int]) -> list[tuple[int, int]]:
        """pad() of each request of one rank (a run of grants, a step's arrivals)."""
        copy, ident, halves, out = self._padder.copy, _IDENT.pack, _HALVES.unpack, []
        for rid in rids:
            h = copy()
            h.update(ident(rank, rid))
            a, b = halves(h.digest())
            out.append((a % P, b % P))
        return out


def _gather_layout(b: MetadataBuffers) -> tuple[np.ndarray, np.ndarray, int, Optional[int]]:
    """Where a slot's words lie in the arena, as 16-bit words: every field but kv_checksum
    (the digested words), then kv_checksum's. Returns (base, step): slot s's words are at
    base + s * step; and where the room's and the tag's words start among them (None: no
    kv_checksum field)."""
    base: list[np.ndarray] = []
    step: list[np.ndarray] = []
    room_at: Optional[int] = None
    tag_at: Optional[int] = None
    covered = [i for i in range(len(b.specs)) if i != b.checksum_field]
    for i in covered + ([b.checksum_field] if b.checksum_field is not None else []):
        n = b.item_lens[i]
        assert n % 2 == 0 and b.offsets[i] % 2 == 0, "fields hold 16-bit words"
        if i == b.room_field:
            room_at = sum(len(x) for x in base)
        if i == b.checksum_field:
            tag_at = sum(len(x) for x in base)
        start = b.offsets[i] // 2
        base.append(np.arange(start, start + n // 2, dtype=np.int64))
        step.append(np.full(n // 2, n // 2, dtype=np.int64))
    assert room_at is not None, "every layout has a room field"
    return np.concatenate(base), np.concatenate(step), room_at, tag_at


def _field_rows(b: MetadataBuffers, u16: np.ndarray) -> list[tuple[np.ndarray, int, int]]:
    """Host rows: each field's rows as 16-bit words, (slots, words) views of the arena, in
    _gather_layout's order, with the columns its words take in a gathered row (lo, hi)."""
    covered = [i for i in range(len(b.specs)) if i != b.checksum_field]
    out, lo = [], 0
    for i in covered + ([b.checksum_field] if b.checksum_field is not None else []):
        n, start = b.item_lens[i] // 2, b.offsets[i] // 2
        out.append((u16[start:start + b.size * n].reshape(b.size, n), lo, lo + n))
        lo += n
    return out


class RowDigest:
    """Digests of a batch of slots of one MetadataBuffers, on its device."""

    def __init__(self, buffers: MetadataBuffers, keys: Keys, kind: DigestKind = DigestKind.linear):
        self.b, self.keys, self.kind = buffers, keys, kind
        self.device = buffers.device
        self.frozen: Optional[np.ndarray] = None  # (slots, 4) sums without the room (fill=ahead)
        self._seal: dict = {}
        self._write: dict = {}
        self._judge: dict = {}
        self.rank_keys: dict[int, Keys] = {}  # receiver: each prefill rank's run-bound keys
        if kind is DigestKind.blake2b:
            if self.device.type != "cpu":
                raise ValueError("verify.digest=blake2b reads rows on the host: host buffers only")
            return
        self.base, self.step, room_at, tag_at = _gather_layout(buffers)
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
        # the arena as 16-bit words and the weights: numpy arrays on host rows, tensors on device rows
        self._u16: Any
        self._w: Any
        if self.device.type == "cpu":
            self._u16 = buffers.arena.numpy().view(np.int16)
            self._w = weights
            # every slot's gather positions, taken once (a step indexes rows of this table)
            self._idx = np.arange(buffers.size, dtype=np.int64)[:, None] * self.step + self.base
            # the same words field by field (a step's read copies rows, not single words)
            self._fields = _field_rows(buffers, self._u16)
            # the receiver's read: the digest's columns, and where the room and tag lie in a row
            self._host_read = (np.ascontiguousarray(weights[:self.words, :4]), room_at, tag_at)
        else:
            dev = self.device
            self._u16 = buffers.arena.view(torch.int16)
            self._w = torch.from_numpy(weights).to(dev)
            slots = torch.arange(buffers.size, dtype=torch.int64)
            self._table = (slots[:, None] * torch.from_numpy(self.step) + torch.from_numpy(self.base)).to(dev)
            # captured by warm() / warm_seal(): bucket -> (graph, pinned slots, pinned sums),
            # (bucket, staged rows) -> (graph, pinned inputs, pinned tags, pinned rows, _Slot),
            # bucket -> (graph, pinned positions and values, _Slot)

    def _product(self, idx: torch.Tensor) -> torch.Tensor:
        """Device rows: (k, 12) int64 sums of the rows at gather positions `idx`."""
        x = self._u16[idx]
        n = x.shape[1]
        if n <= CHUNK_WORDS + 8:
            return (x.to(torch.float64) @ self._w).to(torch.int64)
        out = None
        for lo in range(0, n, CHUNK_WORDS):
            part = (x[:, lo:lo + CHUNK_WORDS].to(torch.float64) @ self._w[lo:lo + CHUNK_WORDS]).to(torch.int64)
            out = part if out is None else out + part
        assert out is not None, "n > CHUNK_WORDS: at least one chunk"
        return out

    # ---- the product ----------------------------------------------------------------------
    def _sums(self, slots: Sequence[int]) -> np.ndarray:
        """(k, 12) int64 host array: c_0..c_3 (not yet reduced mod P), the room's 4 words,
        the landed tag's 4 words."""
        slots = list(slots)
        k = len(slots)
        if self.device.type == "cpu":
            x = self._u16[self._idx[slots]]
            n = x.shape[1]
            if n <= CHUNK_WORDS + 8:  # one product, exact in float64
                return (x.astype(np.float64) @ self._w).astype(np.int64)
            out = np.zeros((k, 12), dtype=np.int64)
            for lo in range(0, n, CHUNK_WORDS):
                out += (x[:, lo:lo + CHUNK_WORDS].astype(np.float64) @ self._w[lo:lo + CHUNK_WORDS]).astype(np.int64)
            return out
        first = slots[0]
        if slots == list(range(first, first + k)):
            gather = self._table[first:first + k]  # a view: no index upload
        else:
            gather = self._table.index_select(0, torch.tensor(slots, dtype=torch.int64).to(self.device))
        x = self._u16[gather]
        n = x.shape[1]
        if n <= CHUNK_WORDS + 8:  # exact integers in float64: converted on the host
            return (x.to(torch.float64) @ self._w).cpu().numpy().astype(np.int64)
        out = sum((x[:, lo:lo + CHUNK_WORDS].to(torch.float64) @ self._w[lo:lo + CHUNK_WORDS]).to(torch.int64)
                  for lo in range(0, n, CHUNK_WORDS))
        return out.cpu().numpy()  # one small copy to the host

    def warm(self) -> None:
        """Device rows: the receiver's read captured as one CUDA graph per batch-size bucket
        (start-up also pays the kernels' first loads and cuBLAS's handle, tens of ms the
        first measured steps would pay otherwise). Reads only."""
        if self.kind is DigestKind.blake2b or self.device.type == "cpu":
            return
        self._sums([0])  # the eager path (sign(), tests) loaded too
        b = self.b
        self._clear_words = b.item_lens[b.room_field] // 8 + (
            b.item_lens[b.checksum_field] // 8 if b.checksum_field is not None else 0)
        for k in buckets(b.size):
            n = k + k * self._clear_words  # the slots to read, then the words to zero
            inp_h = torch.full((n,), b.scratch_word, dtype=torch.int64, pin_memory=True)
            inp_h[:k] = 0
            inp_d = torch.zeros(n, dtype=torch.int64, device=self.device)
            out_h = torch.zeros((k, 12), dtype=torch.int64, pin_memory=True)

            def body(k: int = k, inp_h: torch.Tensor = inp_h, inp_d: torch.Tensor = inp_d,
                     out_h: torch.Tensor = out_h) -> None:
                inp_d.copy_(inp_h, non_blocking=True)
                b.words.index_fill_(0, inp_d[k:], 0)  # freed slots' rooms zeroed (else: scratch)
                out_h.copy_(self._product(self._table.index_select(0, inp_d[:k])), non_blocking=True)

            self._judge[k] = (_capture(body), inp_h.numpy(), out_h.numpy())

    def warm_seal(self, max_batch: int, rows: Optional[StagedRows] = None) -> None:
        """Device rows, sender: the step's seal captured per bucket up to `max_batch` slots,
        with the staged-rows scatter too when `rows` (a buffers.StagedRows) is given. Call on
        fresh buffers: capturing runs each graph, which writes slot 0's own content back and
        the rest into the scratch."""
        if self.kind is DigestKind.blake2b or self.device.type == "cpu":
            return
        b = self.b
        sizes = buckets(min(max_batch, b.size))
        for k in sizes:
            for staged in ([False, True] if rows is not None else [False]):
                self._seal[(k, staged)] = _Ring([self._capture_seal(k, rows if staged else None)
                                                 for _ in range(RING)])
            self._write[k] = _Ring([self._capture_write(k) for _ in range(RING)])
        self._seal_sizes = sizes

    def _capture_write(self, k: int) -> tuple:
        """fill=ahead: a step's rooms (and tags with their signature) as one upload and one
        indexed write, per bucket."""
        b = self.b
        m = 3 if b.checksum_field is not None else 1
        inp_h = torch.zeros((2, m * k), dtype=torch.int64, pin_memory=True)
        inp_h[0] = b.scratch_word
        inp_d = torch.zeros((2, m * k), dtype=torch.int64, device=self.device)

        def body() -> None:
            inp_d.copy_(inp_h, non_blocking=True)
            b.words.index_copy_(0, inp_d[0], inp_d[1])

        graph = _capture(body)
        if m == 3:  # every tag's signature word: the same value on every replay
            inp_h[1].view(m, k)[2] = _as_i64(SIGNATURE)
        return graph, inp_h.numpy(), _Slot()

    def _capture_seal(self, k: int, rows: Optional[StagedRows]) -> tuple:
        b, dev = self.b, self.device
        inp_h = torch.zeros((6, k), dtype=torch.int64, pin_memory=True)
        inp_h[1] = inp_h[5] = b.scratch_word  # capture-time writes land in the scratch
        inp_d = torch.zeros((6, k), dtype=torch.int64, device=dev)
        out_h = torch.zeros((k, 2), dtype=torch.int64, pin_memory=True)
        sig = torch.full((k,), _as_i64(SIGNATURE), dtype=torch.int64, device=dev)
        fields = [t.view(torch.uint8) for t in b.fields]  # (size, item_len)
        rows_h = rows_d = None
        if rows is not None:
            rows_h = torch.zeros((k, b.row_bytes), dtype=torch.uint8, pin_memory=True)
            rows.pack([0] * k, rows_h.numpy())  # slot 0 as it is: capture writes it back unchanged
            rows_d = torch.zeros((k, b.row_bytes), dtype=torch.uint8, device=dev)
            cols = rows.cols

        def body() -> None:
            inp_d.copy_(inp_h, non_blocking=True)
            slots = inp_d[0]
            if rows_d is not None and rows_h is not None:  # (set together)
                rows_d.copy_(rows_h, non_blocking=True)
                for f, t in enumerate(fields):
                    t.index_copy_(0, slots, rows_d[:, cols[f]:cols[f + 1]])
            b.words.index_copy_(0, inp_d[1], inp_d[2])
            sums = self._product(self._table.index_select(0, slots))
            c = torch.remainder(sums[:, :4], P)
            tag = (torch.remainder(c[:, 0] + inp_d[3], P) | (torch.remainder(c[:, 1] + inp_d[4], P) << 24)) | MARK
            if b.checksum_field is not None:
                b.words.index_copy_(0, inp_d[5], tag)
                b.words.index_copy_(0, inp_d[5] + 1, sig)
            out_h.copy_(torch.stack([tag, c[:, 2] | (c[:, 3] << 24)], 1), non_blocking=True)

        graph = _capture(body)
        return graph, inp_h.numpy(), out_h.numpy(), None if rows_h is None else rows_h.numpy(), _Slot()

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

    def seal(self, slots: Sequence[int], rooms: Sequence[int], pads: Sequence[tuple[int, int]],
             idents: Sequence[tuple[int, int]], rows: Optional[StagedRows] = None, ahead: bool = False) -> Sealed:
        """A step's rows made ready to send: the rooms written, the digest taken and its tag
        written into kv_checksum (where the layout has it). `rows` (a buffers.StagedRows):
        the step's rows are first uploaded from it. `ahead`: the rows are as fill_ahead left
        them but for their rooms (host rows then use the frozen sums). Device rows: queued,
        nothing waits."""
        if ahead and self.frozen is not None and self.device.type != "cpu":
            return self._seal_ahead(slots, rooms, pads, idents)
        if self.device.type == "cpu" or self.kind is DigestKind.blake2b or not self._seal:
            return self._seal_eager(slots, rooms, pads, idents, ahead)
        return self._seal_graph(slots, rooms, pads, rows)

    def _seal_ahead(self, slots: Sequence[int], rooms: Sequence[int], pads: Sequence[tuple[int, int]],
                    idents: Sequence[tuple[int, int]]) -> Sealed:
        """Device rows as frozen but for their rooms: sign on the host, then one upload and one
        indexed write of the rooms and tags (no digest on the device)."""
        b = self.b
        k = len(slots)
        step = self._frozen_step(slots, rooms, pads) if k >= 8 else None  # a step of many: as arrays
        if step is not None:
            at, room, tag_arr, contents = step
            tags = tag_arr.tolist()
        else:
            tags, contents = self.sign_rooms(slots, rooms, pads, idents)
        if not self._write:
            b.write_rooms(slots, rooms, tags if b.checksum_field is not None else None, SIGNATURE)
            return Sealed(tags, contents)
        kb = bucket_of(k, self._seal_sizes)
        graph, inp, slot = self._write[kb].next()
        slot.reuse(self.device)
        m = 3 if b.checksum_field is not None else 1  # (val[2], the signature, is set at capture)
        pos, val = inp[0].reshape(m, kb), inp[1].reshape(m, kb)
        if k == 1:  # one in flight: no array built
            pos[:, 0] = b.slot_words[slots[0], :m]
            val[0, 0] = _as_i64(rooms[0])
            if m == 3:
                val[1, 0] = _as_i64(tags[0])
        elif step is not None:
            pos[:, :k] = b.slot_words[at, :m].T
            val[0, :k] = room.view(np.int64)  # _as_i64 of each
            if m == 3:
                val[1, :k] = tag_arr  # (tags are below 2^63)
        else:
            pos[:, :k] = b.slot_words[list(slots), :m].T
            val[0, :k] = [_as_i64(r) for r in rooms]
            if m == 3:
                val[1, :k] = [_as_i64(t) for t in tags]
        if kb > k:
            pos[:, k:] = pos[:, :1]
            val[:2, k:] = val[:2, :1]
        graph.replay()
        slot.last = sealed = Sealed(tags, contents)  # no event: the slot waits for its landing (_Slot)
        return sealed

    def _seal_eager(self, slots: Sequence[int], rooms: Sequence[int], pads: Sequence[tuple[int, int]],
                    idents: Sequence[tuple[int, int]], ahead: bool) -> Sealed:
        """Host rows, blake2b, or no captured graph: the rooms, the tags and their writes one
        after the other."""
        b = self.b
        if ahead and self.frozen is not None and len(slots) >= 8 and self.device.type == "cpu":
            return self._seal_frozen_host(slots, rooms, pads)
        b.write_rooms(slots, rooms)
        if ahead and self.frozen is not None:
            tags, contents = self.sign_rooms(slots, rooms, pads, idents)
        else:
            tags, contents = self.sign(slots, idents, pads)
        if b.checksum_field is not None:
            b.write_checksums(slots, tags, SIGNATURE)
        return Sealed(tags, contents)

    def _seal_frozen_host(self, slots: Sequence[int], rooms: Sequence[int],
                          pads: Sequence[tuple[int, int]]) -> Sealed:
        """Host rows as frozen but for their rooms, a step of many: the rooms, the sums, the
        tags and their writes as arrays over the step (what sign_rooms and write_rooms,
        write_checksums give row by row)."""
        b = self.b
        at, room, tags, contents = self._frozen_step(slots, rooms, pads)
        b.write_rooms(at, room)
        if b.checksum_field is not None:
            b.write_checksums(at, tags, SIGNATURE)
        return Sealed(tags.tolist(), contents)

    def _frozen_step(self, slots: Sequence[int], rooms: Sequence[int], pads: Sequence[tuple[int, int]]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """fill=ahead, a step of many: the slots (int64) and rooms (uint64) as arrays, the tags
        (int64) and the fingerprints of frozen rows that now hold `rooms`: sign_rooms' row by
        row arithmetic over the step at once (each room's words its little-endian int16 view)."""
        at = np.asarray(slots, dtype=np.int64)
        room = np.array(rooms, dtype=np.uint64)
        words = room.astype("<u8").view("<i2").reshape(-1, 4).astype(np.int64)  # _split of each room
        c = np.mod(self.frozen[at] + words @ self._room_rows_np, P)  # type: ignore[index]  # set (caller)
        pad = np.fromiter(itertools.chain.from_iterable(pads), np.int64, 2 * len(at)).reshape(-1, 2)
        tags = np.mod(c[:, 0] + pad[:, 0], P) | (np.mod(c[:, 1] + pad[:, 1], P) << 24) | MARK  # pack_tag's
        return at, room, tags, ["%012x" % v for v in (c[:, 2] | c[:, 3] << 24).tolist()]

    def _seal_graph(self, slots: Sequence[int], rooms: Sequence[int], pads: Sequence[tuple[int, int]],
                    rows: Optional[StagedRows]) -> Sealed:
        """Device rows: the step's seal graph of its bucket replayed (rooms written, digest
        taken, tags written, with `rows` the staged rows uploaded first); queued."""
        b = self.b
        k = len(slots)
        kb = bucket_of(k, self._seal_sizes)
        graph, inp, out, packed, slot = self._seal[(kb, rows is not None)].next()
        slot.reuse(self.device)
        at = b.slot_words[list(slots)]
        inp[0, :k] = slots
        inp[1, :k] = at[:, 0]
        inp[2, :k] = [_as_i64(r) for r in rooms]
        inp[3, :k] = [p[0] for p in pads]
        inp[4, :k] = [p[1] for p in pads]
        if b.checksum_field is not None:
            inp[5, :k] = at[:, 1]
        if kb > k:
            inp[:, k:] = inp[:, :1]
        pack_s = 0.0
        if rows is not None:
            t0 = time.perf_counter()
            rows.pack(slots, packed)
            if kb > k:
                packed[k:] = packed[0]
            pack_s = time.perf_counter() - t0
        graph.replay()
        slot.event.record()
        slot.last = Sealed(out=out, k=k, event=slot.event, pack_s=pack_s)
        return slot.last

    def freeze(self) -> None:
        """fill=ahead: every slot's sums without its room, taken once (on the rows' device);
        a step then signs on the host and writes only rooms and tags."""
        if self.kind is DigestKind.blake2b:
            return
        sums = self._sums(range(self.b.size))
        rooms = sums[:, 4:8].astype(np.float64)
        self.frozen = np.mod(sums[:, :4] - (rooms @ self.room_rows).astype(np.int64), P)
        self._frozen_rows = self.frozen.tolist()  # Python ints: a step of a few rows is host arithmetic
        self._room_rows_np = self.room_rows.astype(np.int64)
        self._room_rows = self._room_rows_np.tolist()

    def sign_rooms(self, slots: Sequence[int], rooms: Sequence[int],
                   pads: Sequence[tuple[int, int]], idents: Sequence[tuple[int, int]]) -> tuple[list[int], list[str]]:
        """fill=ahead: the tags of frozen rows that now hold `rooms` (host arithmetic)."""
        if self.frozen is None:
            return self.sign(slots, idents, pads)
        if len(slots) >= 8:  # a step of many rows: one vectorized pass
            _, _, tags, contents = self._frozen_step(slots, rooms, pads)
            return tags.tolist(), contents
        frozen, rr = self._frozen_rows, self._room_rows
        c = []
        for slot, room in zip(slots, rooms):
            w = _split(room)
            c.append([(frozen[slot][j] + w[0] * rr[0][j] + w[1] * rr[1][j] + w[2] * rr[2][j]
                       + w[3] * rr[3][j]) % P for j in range(4)])
        return self._tags(c, pads)

    @staticmethod
    def _tags(c: list[list[int]], pads: Sequence[tuple[int, int]]) -> tuple[list[int], list[str]]:
        tags = [pack_tag(row[0], row[1], pad) for row, pad in zip(c, pads)]
        return tags, [f"{row[2] | row[3] << 24:012x}" for row in c]

    # ---- receiver ---------------------------------------------------------------------------
    def read(self, slots: Sequence[int], idents: Sequence[tuple[int, int]],
             clear: Sequence[int] = (), stream: Optional["torch.cuda.Stream"] = None) -> list[RowCheck]:
        """What landed in `slots`, a RowCheck each (read_step, one row at a time)."""
        return self.read_step(slots, idents, clear, stream).checks()

    def read_step(self, slots: Sequence[int], idents: Sequence[tuple[int, int]],
                  clear: Sequence[int] = (), stream: Optional["torch.cuda.Stream"] = None) -> "StepRead":
        """What landed in `slots`: sums, content, room and tag, in one pass (one D2H), as
        arrays. The slots in `clear` (none of `slots`) are zeroed first, as clear_slots()
        does (device rows: in the same graph replay, covered by the same one wait). `stream`:
        device rows, run the pass and its wait on that stream (gate.read=side_stream)."""
        if clear and (self.device.type == "cpu" or not self._judge):
            self.b.clear_slots(clear)
            clear = ()
        if self.kind is DigestKind.blake2b:
            out = []
            for slot, ident in zip(slots, idents):
                tag, content = self._blake(slot, ident)
                landed = self.b.get_kv_checksum(slot)[0] if self.b.checksum_field is not None else 0
                out.append(RowCheck((tag, 0), content, self.b.room(slot), landed))
            return StepRead.of_checks(out)
        if self.device.type == "cpu":
            return self._read_host(slots)
        if not self._judge:  # not warmed: the eager path
            return _fold(self._sums(slots), self.has_tag)
        if stream is None:
            return _fold(self._read_graph(slots, clear), self.has_tag)
        with torch.cuda.stream(stream):
            return _fold(self._read_graph(slots, clear), self.has_tag)

    def _read_host(self, slots: Sequence[int]) -> "StepRead":
        """Host rows: the digest's four columns in one product; the room's and the landed
        tag's words read as they lie (what the one-hot columns give on device rows). A few
        slots are gathered in one take through the gather table; more a field at a time (a
        run of slots: a slice of each), cast to float64 as they are copied (one pass over
        the step's words, not a copy and then a cast)."""
        w, room_at, tag_at = self._host_read
        k = len(slots)
        x: np.ndarray
        if k <= _TAKE_MOST:
            x = self._u16.take(self._idx[slots[0]] if k == 1 else self._idx[list(slots)]).reshape(k, -1)
            words = x  # int16 as it lies
        else:
            x = np.empty((k, len(self.base)), dtype=np.float64)
            first = slots[0]
            if slots[-1] - first == k - 1 and list(slots) == list(range(first, first + k)):
                for rows, lo, hi in self._fields:  # a run of slots: each field's rows are one block
                    x[:, lo:hi] = rows[first:first + k]
            else:
                at = np.fromiter(slots, dtype=np.intp, count=k)
                for rows, lo, hi in self._fields:
                    x[:, lo:hi] = rows[at]
            words = None  # the room's and tag's words, cast back below (exact: 16-bit values)
        n = self.words
        if n <= CHUNK_WORDS + 8:  # one product, exact in float64
            sums = (x[:, :n] @ w if words is None else x[:, :n].astype(np.float64) @ w).astype(np.int64)
        else:
            sums = np.zeros((k, 4), dtype=np.int64)
            for lo in range(0, n, CHUNK_WORDS):
                hi = min(n, lo + CHUNK_WORDS)
                sums += (x[:, lo:hi].astype(np.float64, copy=False) @ w[lo:hi]).astype(np.int64)

        def u64(at: int) -> np.ndarray:
            part = x[:, at:at + 4]
            return (np.ascontiguousarray(part) if words is not None else part.astype(np.int16)).view(np.uint64)[:, 0]

        rooms = u64(room_at)
        tags = u64(tag_at) if tag_at is not None else np.zeros(k, dtype=np.uint64)
        return StepRead(np.mod(sums, P), rooms, tags)

    def _read_graph(self, slots: Sequence[int], clear: Sequence[int] = ()) -> np.ndarray:
        """Device rows: one graph replay, whose bucket holds the slots to read and those in
        `clear` to zero (a step padded to its bucket reads its first slot again), then the
        step's one wait. Returns the replay's (k, 12) sums, copied out of its pinned output."""
        b = self.b
        k = len(slots)
        kb = bucket_of(max(k, len(clear)), self._judge)
        graph, inp, out = self._judge[kb]
        if k == 1:
            inp[0] = slots[0]
        else:
            inp[:k] = slots
        if kb > k:
            inp[k:kb] = inp[0]
        n = 0
        if clear:
            inside = clear[:kb]
            if len(clear) > kb:  # (never: the largest bucket holds every slot) queued before it, the same wait
                b.clear_slots(list(clear[kb:]))
            words = b.slot_words[inside[0]] if len(inside) == 1 else b.slot_words[list(inside)].reshape(-1)
            n = len(words)
            inp[kb:kb + n] = words
        inp[kb + n:] = b.scratch_word
        graph.replay()
        torch.cuda.current_stream(self.device).synchronize()
        return out[:k].copy()

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
