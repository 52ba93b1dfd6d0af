"""MetadataBuffers: SGLang's aux-metadata rows, one tensor per field, one row per request.

Field set, shapes, dtypes and order follow SGLang (see shared/notes/sglang-aux-path.md), so
`get_buf_infos()` is interchangeable with SGLang's and both sides of a handoff agree on item
lengths. One deliberate difference: all fields are carved out of ONE backing allocation
(each field 256-byte aligned). That is one memory registration with Mooncake instead of ten,
one CUDA IPC handle for the NVLink transport, and plain cudaMalloc-backed memory (the only
kind the intra-node NVLink transport can register). Pointers, lengths and row layout are the
same as SGLang's separate tensors.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .config import HiddenStatesDtype, MemPoolType
from .plan import Device, Platform, buffer_device

_ALIGN = 256
_CUDA_SEGMENT = 2 << 20

TORCH_DTYPES = {
    HiddenStatesDtype.float32: torch.float32,
    HiddenStatesDtype.bfloat16: torch.bfloat16,
    HiddenStatesDtype.float16: torch.float16,
}


@dataclass(frozen=True)
class FieldSpec:
    name: str
    width: int
    dtype: torch.dtype
    fill: int = 0


def field_specs(
    hidden_size: int,
    hidden_states_dtype: torch.dtype,
    max_top_logprobs_num: int = 128,
    output_dsa_topk_indices_dim: int = 0,
) -> list[FieldSpec]:
    """SGLang's fields in SGLang's order; the optional DSA field sits just before bootstrap_room."""
    specs = [
        FieldSpec("output_ids", 16, torch.int32),
        FieldSpec("cached_tokens", 16, torch.int32),
        FieldSpec("output_token_logprobs_val", 16, torch.float32),
        FieldSpec("output_token_logprobs_idx", 16, torch.int32),
        FieldSpec("output_top_logprobs_val", max_top_logprobs_num, torch.float32),
        FieldSpec("output_top_logprobs_idx", max_top_logprobs_num, torch.int32),
        FieldSpec("output_topk_p", 16, torch.float32),
        FieldSpec("output_topk_index", 16, torch.int64),
        FieldSpec("output_hidden_states", hidden_size, hidden_states_dtype),
    ]
    if output_dsa_topk_indices_dim > 0:
        specs.append(FieldSpec("output_dsa_topk_indices", output_dsa_topk_indices_dim, torch.int32, fill=-1))
    specs.append(FieldSpec("bootstrap_room", 8, torch.uint64))
    return specs


def _to_torch_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, HiddenStatesDtype):
        return TORCH_DTYPES[dtype]
    return getattr(torch, str(dtype))


class MetadataBuffers:
    """SGLang-compatible aux buffers. Constructor arguments match SGLang's; `device` (or
    `mem_pool`) are keyword-only extras that say where the rows live. Without them the
    device rule of orchestrator.plan applies to `mem_pool` (a custom pool object means
    host memory, as in SGLang)."""

    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: Any,
        max_top_logprobs_num: int = 128,
        custom_mem_pool: Any = None,
        output_dsa_topk_indices_dim: int = 0,
        *,
        mem_pool: MemPoolType = MemPoolType.NONE,
        device: Optional[torch.device | str] = None,
    ):
        if size <= 0 or hidden_size <= 0:
            raise ValueError(f"size and hidden_size must be > 0, got {size}, {hidden_size}")
        if device is None:
            placed = Device.cpu if custom_mem_pool is not None else buffer_device(
                mem_pool, Platform(cuda_devices=torch.cuda.device_count())
            )
            device = placed.value
        self.device = torch.device(device)
        self.size = size
        self.specs = field_specs(hidden_size, _to_torch_dtype(hidden_states_dtype),
                                 max_top_logprobs_num, output_dsa_topk_indices_dim)
        offsets, total = [], 0
        for spec in self.specs:
            offsets.append(total)
            nbytes = size * spec.width * spec.dtype.itemsize
            total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        # The caching allocator hands out 512-byte aligned blocks; over-allocate to align.
        # On CUDA, a whole multiple of 2 MiB makes the arena its own cudaMalloc segment, so
        # its pointer is the allocation base that CUDA IPC (and Mooncake's NVLink
        # registration) hands to the peer.
        nbytes_arena = total + _ALIGN
        if self.device.type == "cuda":
            nbytes_arena = -(-nbytes_arena // _CUDA_SEGMENT) * _CUDA_SEGMENT
        self._arena = torch.zeros(nbytes_arena, dtype=torch.uint8, device=self.device)
        shift = (-self._arena.data_ptr()) % _ALIGN
        self.fields: list[torch.Tensor] = []
        for spec, off in zip(self.specs, offsets):
            nbytes = size * spec.width * spec.dtype.itemsize
            raw = self._arena[shift + off: shift + off + nbytes]
            tensor = raw.view(spec.dtype).view(size, spec.width)
            if spec.fill:
                tensor.fill_(spec.fill)
            self.fields.append(tensor)
            setattr(self, spec.name, tensor)
        self.arena_ptr = self._arena.data_ptr() + shift
        self.arena_bytes = total
        self.item_lens = [t[0].nbytes for t in self.fields]
        self.row_bytes = sum(self.item_lens)
        self._field_ptrs = [t.data_ptr() for t in self.fields]
        self._gather: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # built on first use

    # ---- SGLang's surface -------------------------------------------------------------
    def get_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data pointers, total byte lengths, one row's byte length), in field order."""
        ptrs = [t.data_ptr() for t in self.fields]
        lens = [t.nbytes for t in self.fields]
        return ptrs, lens, list(self.item_lens)

    def get_buf(self, idx: int) -> tuple[torch.Tensor, ...]:
        """Copies of row `idx` of every field, in field order."""
        return tuple(t[idx].clone() for t in self.fields)

    def set_buf(self, req: Any) -> None:
        """Write row req.metadata_buffer_index from an SGLang-like request object."""
        slot = req.metadata_buffer_index
        self.output_ids[slot][0] = req.output_ids[0]
        cached = (req.cached_tokens, req.cached_tokens_device, req.cached_tokens_host,
                  req.cached_tokens_storage)
        self.cached_tokens[slot][: len(cached)] = torch.tensor(cached, dtype=torch.int32)
        if req.return_logprob:
            _write_prefix(self.output_token_logprobs_val[slot], req.output_token_logprobs_val[0])
            _write_prefix(self.output_token_logprobs_idx[slot], req.output_token_logprobs_idx[0])
            _write_prefix(self.output_top_logprobs_val[slot], req.output_top_logprobs_val[0])
            _write_prefix(self.output_top_logprobs_idx[slot], req.output_top_logprobs_idx[0])
        if getattr(req, "hidden_states_tensor", None) is not None:
            _write_prefix(self.output_topk_p[slot], req.output_topk_p)
            _write_prefix(self.output_topk_index[slot], req.output_topk_index)
            self.output_hidden_states[slot].copy_(req.hidden_states_tensor.to(self.output_hidden_states.dtype))
        dsa = getattr(req, "output_dsa_topk_indices", None)
        if dsa is not None and hasattr(self, "output_dsa_topk_indices"):
            _write_prefix(self.output_dsa_topk_indices[slot], dsa)
        room = req.bootstrap_room
        self.bootstrap_room[slot][0] = 0 if room is None else room

    # ---- what the orchestrator adds ---------------------------------------------------
    def room(self, slot: int) -> int:
        return int(self.bootstrap_room[slot, 0].item())

    @property
    def room_offset(self) -> int:
        """Byte offset of bootstrap_room[slot, 0] inside a row snapshot (it is always last)."""
        return self.row_bytes - self.item_lens[-1]

    def row_snapshot(self, slot: int) -> bytes:
        """Row `slot` of every field, in field order, as host bytes: one gather and one
        device->host copy for device buffers, plain memory reads for host buffers."""
        if self.device.type == "cpu":
            return b"".join(ctypes.string_at(p + n * slot, n)
                            for p, n in zip(self._field_ptrs, self.item_lens))
        return self._gathered_snapshot(slot)

    def _gathered_snapshot(self, slot: int) -> bytes:
        if self._gather is None:
            # Byte positions of row 0 of every field in the arena, and how far each moves
            # per slot: a device row snapshot is then one add, one index_select, one copy.
            arena0 = self.arena_ptr - self._arena.data_ptr()
            base, step = [], []
            for t, n in zip(self.fields, self.item_lens):
                start = arena0 + t.data_ptr() - self.arena_ptr
                base.append(torch.arange(start, start + n, dtype=torch.int64))
                step.append(torch.full((n,), n, dtype=torch.int64))
            self._gather = (torch.cat(base).to(self.device), torch.cat(step).to(self.device))
        gather_base, gather_step = self._gather
        index = torch.add(gather_base, gather_step, alpha=slot)
        row = self._arena.index_select(0, index).cpu()
        return ctypes.string_at(row.data_ptr(), row.numel())

    @staticmethod
    def snapshot_room(snapshot: bytes, offset: int) -> int:
        return int.from_bytes(snapshot[offset: offset + 8], "little")

    def clear_room(self, slot: int) -> None:
        """Zero a freed slot's bootstrap_room, so a stale room never passes the readiness gate."""
        self.bootstrap_room[slot, 0] = 0

    def flip_byte(self, slot: int, field_index: int, offset: int = 0) -> None:
        """Fault injection (faults.kind=corrupt_byte): change one byte of one field's row."""
        self.fields[field_index][slot].view(torch.uint8)[offset] ^= 0x5A

    def row_checksum(self, slot: int) -> str:
        """blake2b over row `slot` of every field, in field order."""
        return checksum(self.row_snapshot(slot))


def checksum(snapshot: bytes) -> str:
    return hashlib.blake2b(snapshot, digest_size=16).hexdigest()


def _write_prefix(dst_row: torch.Tensor, values: Sequence | torch.Tensor) -> None:
    src = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dst_row.dtype)
    src = src.reshape(-1)
    n = min(src.numel(), dst_row.numel())
    dst_row[:n] = src[:n].to(dst_row.dtype)


class SlotAllocator:
    """Free-list of buffer rows. LIFO reuse on purpose: a freed row is reused first, which is
    exactly when a stale bootstrap_room would bite if freeing did not zero it."""

    def __init__(self, size: int):
        self._free = list(range(size - 1, -1, -1))
        self._used: set[int] = set()

    def alloc(self) -> Optional[int]:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)

    @property
    def available(self) -> int:
        return len(self._free)
