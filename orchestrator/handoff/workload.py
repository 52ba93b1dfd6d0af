"""Synthetic prefill results: SGLang-shaped request objects, deterministic from (seed, index),
generated before the timed phase (a pool of distinct requests that requests reuse in turn),
plus the arrival schedule of an open-loop run.

The sender fills its MetadataBuffers row from one of these exactly as SGLang's set_buf
would from a finished prefill request; the receiver never sees the generator, only bytes.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol

import numpy as np
import torch

from orchestrator.handoff.specs import WorkloadSpec

_ROOM_MASK = (1 << 63) - 1
VOCAB = 152_000
POOL = 256  # distinct synthetic requests per run (request i reuses entry i % POOL)


_ROOM_HASH = hashlib.blake2b(digest_size=8, person=b"orch-room")  # set up once; a room copies it
_SEED_GROUP = struct.Struct("<QQ").pack


def room_for(seed: int, group: int) -> int:
    """A nonzero 63-bit bootstrap room; a different stream for every seed."""
    h = _ROOM_HASH.copy()
    h.update(_SEED_GROUP(seed, group))
    return (int.from_bytes(h.digest(), "little") & _ROOM_MASK) or 1


class Rooms(Protocol):
    """What a request's room is drawn from: workload.seed and workload.duplicate_rooms (a
    WorkloadSpec; the job's recovery reads them off its config)."""

    @property
    def seed(self) -> Optional[int]: ...

    @property
    def duplicate_rooms(self) -> int: ...


def seed_of(w: Rooms) -> int:
    """The workload's seed. A run resolves a null one first (runner.run_handoffs draws it);
    a library caller outside any run gets 0."""
    return 0 if w.seed is None else w.seed


def decode_of(rid: int, n: int) -> int:
    """The decode instance (of `n`) that request `rid` hands off to: every prefill rank deals
    its requests round-robin over the decode instances."""
    return rid % n


def room_of(w: Rooms, rid: int) -> int:
    """Request `rid`'s room: `duplicate_rooms` consecutive requests share one (retries, n>1)."""
    return request_room(seed_of(w), w.duplicate_rooms, rid)


def request_room(seed: int, duplicate_rooms: int, rid: int) -> int:
    """room_of from the two values it reads (the workload's seed, as seed_of gives it)."""
    return room_for(seed, rid // duplicate_rooms)


def request_rooms(seed: int, duplicate_rooms: int, rids: Iterable[int]) -> list[int]:
    """request_room of each (a pass's arrivals)."""
    return [room_for(seed, rid // duplicate_rooms) for rid in rids]


@dataclass
class Logprob:
    """What SGLang's set_buf reads from req.logprob."""

    output_token_logprobs_val: list = field(default_factory=list)
    output_token_logprobs_idx: list = field(default_factory=list)
    output_top_logprobs_val: list = field(default_factory=list)
    output_top_logprobs_idx: list = field(default_factory=list)


@dataclass(frozen=True)
class SamplingMaskChunk:
    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32


@dataclass
class SamplingMaskRows:
    chunk: SamplingMaskChunk

    def view(self) -> SamplingMaskChunk:
        return self.chunk


@dataclass
class AuxRequest:
    """The attributes of SGLang 0.5.23's Req that MetadataBuffers.set_buf reads."""

    rid: int
    bootstrap_room: Optional[int]
    output_ids: list[int]
    cached_tokens: int
    cached_tokens_device: int
    cached_tokens_host: int
    cached_tokens_storage: int
    return_logprob: bool
    logprob: Logprob = field(default_factory=Logprob)
    return_sampling_mask: bool = False
    sampling_mask_rows: Optional[SamplingMaskRows] = None
    hidden_states_tensor: Optional[torch.Tensor] = None
    output_topk_p: Optional[torch.Tensor] = None
    output_topk_index: Optional[torch.Tensor] = None
    output_dsa_topk_indices: Optional[torch.Tensor] = None
    mm_tokens: tuple[int, int, int] = (0, 0, 0)
    metadata_buffer_index: int = -1

    def get_mm_token_counts(self) -> tuple[int, int, int]:
        return self.mm_tokens


@dataclass(frozen=True)
class Shapes:
    """The row widths a request must fit (from the buffers it will be written into)."""

    hidden_size: int
    hidden_dtype: torch.dtype = torch.float32
    dsa_dim: int = 0
    max_sampling_mask_tokens: int = 256
    device: str = "cpu"


def make_request(w: WorkloadSpec, index: int, shapes: Shapes) -> AuxRequest:
    g = torch.Generator().manual_seed((seed_of(w) * 1_000_003 + index) % (1 << 63))
    prompt = int(torch.randint(16, 8192, (1,), generator=g).item())
    cached = int(torch.randint(0, prompt, (1,), generator=g).item())
    device_part = int(torch.randint(0, cached + 1, (1,), generator=g).item())
    req = AuxRequest(
        rid=index,
        bootstrap_room=room_of(w, index),
        output_ids=[int(torch.randint(0, VOCAB, (1,), generator=g).item())],
        cached_tokens=cached,
        cached_tokens_device=device_part,
        cached_tokens_host=cached - device_part,
        cached_tokens_storage=0,
        return_logprob=w.return_logprob,
    )
    if w.multimodal:
        image, audio, video = (int(v) for v in torch.randint(0, 4096, (3,), generator=g))
        req.mm_tokens = (image, audio, video)
    if w.return_logprob:
        k = w.top_logprobs_num
        top = torch.sort(-torch.rand(k, generator=g) * 10).values.tolist()
        first = top[0] if k else -float(torch.rand(1, generator=g))
        req.logprob = Logprob([first], [req.output_ids[0]], [top],
                              [torch.randint(0, VOCAB, (k,), generator=g).tolist()])
    if w.sampling_mask:
        n = min(32, shapes.max_sampling_mask_tokens)  # one length per run: rows stay comparable
        ids = torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32).numpy()
        lps = (-torch.rand(n, generator=g) * 10).numpy().astype(np.float32)
        req.return_sampling_mask = True
        req.sampling_mask_rows = SamplingMaskRows(SamplingMaskChunk(ids, lps))
    if w.hidden_states:
        dev = shapes.device
        req.hidden_states_tensor = torch.randn(shapes.hidden_size, generator=g).to(shapes.hidden_dtype).to(dev)
        req.output_topk_p = torch.softmax(torch.randn(16, generator=g), 0).to(dev)
        req.output_topk_index = torch.randint(0, VOCAB, (16,), generator=g, dtype=torch.int64).to(dev)
        if shapes.dsa_dim and w.dsa_indices:
            req.output_dsa_topk_indices = torch.randint(
                0, 1 << 16, (shapes.dsa_dim,), generator=g, dtype=torch.int32).to(dev)
    return req


class RequestPool:
    """Distinct synthetic requests made before the timed phase; request `rid` fills its row
    from entry rid % len(pool), with its own room and slot. Generation is never timed."""

    def __init__(self, w: WorkloadSpec, shapes: Shapes, size: int = POOL):
        self.w = w
        self.entries = [make_request(w, i, shapes) for i in range(size)]

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, rid: int, slot: int) -> AuxRequest:
        req = self.entries[rid % len(self.entries)]
        req.rid, req.bootstrap_room, req.metadata_buffer_index = rid, room_of(self.w, rid), slot
        return req


def arrival_offsets(rate: Optional[float], seed: Optional[int], n: int, rank: int = 0,
                    burstiness: float = 1.0, duration_s: Optional[float] = None) -> Optional[np.ndarray]:
    """Open loop: seconds from the start at which request i arrives, seeded per rank; None for
    a closed loop (which needs no seed). The gaps are gamma-distributed with shape
    `burstiness` and mean 1/rate, as vLLM's --burstiness (1: exponential, a Poisson process,
    drawn exactly as before the knob existed). With `duration_s`, the arrivals up to it (at
    most `n`), drawn in chunks: a long run's ceiling is never allocated."""
    if rate is None:
        return None
    assert seed is not None  # an open loop runs with its seed resolved (config.with_seed)
    rng = np.random.Generator(np.random.Philox(key=[seed & ((1 << 64) - 1), rank]))

    def gaps(k: int) -> np.ndarray:
        if burstiness == 1:
            return rng.exponential(1.0 / rate, size=k)
        return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=k)

    if duration_s is None:
        return np.cumsum(gaps(n))
    chunks: list[np.ndarray] = []
    t, drawn = 0.0, 0
    chunk = max(1024, min(n, int(rate * duration_s * 1.1) + 1))
    while drawn < n and t <= duration_s:
        c = t + np.cumsum(gaps(min(chunk, n - drawn)))
        chunks.append(c)
        t, drawn = float(c[-1]), drawn + len(c)
    offsets = np.concatenate(chunks) if chunks else np.empty(0)
    return offsets[offsets <= duration_s][:n]
