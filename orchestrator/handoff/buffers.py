"""MetadataBuffers: SGLang's aux-metadata rows, one tensor per field, one row per request.

The fields come from a layout declaration (conf/layout/*.yaml, default SGLang 0.5.23), and
the constructor signature, attributes, get_buf_infos(), get_buf(), set_buf(),
set_kv_checksum(), get_kv_checksum() and clear_slot() follow SGLang 0.5.23 exactly, so code
written against SGLang's class runs on this one. One deliberate difference: all fields are
carved out of ONE backing allocation (each field 256-byte aligned). That is one memory
registration with Mooncake instead of ten, one CUDA IPC handle for the NVLink transport, and
plain cudaMalloc-backed memory (the only kind the intra-node NVLink transport can register).
Pointers, lengths and row layout are the same as SGLang's separate tensors.
"""

from __future__ import annotations

import ctypes
import os
import random
import secrets
import warnings
from typing import Any, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from orchestrator.profile.kinds import HiddenStatesDtype, MemPoolType
from orchestrator.profile.layout import Declaration, FieldSpec, Sizes, field_specs, get_buf_names, load_layout
from orchestrator.profile.plan import Device, Platform, buffer_device

_ALIGN = 256
WARM_BYTES = _ALIGN
_CUDA_SEGMENT = 2 << 20
_U64 = (1 << 64) - 1

TORCH_DTYPES = {
    HiddenStatesDtype.float32: torch.float32,
    HiddenStatesDtype.bfloat16: torch.bfloat16,
    HiddenStatesDtype.float16: torch.float16,
}
_DEFAULT_LAYOUT: Optional[Declaration] = None
Rows64 = Union[np.ndarray, torch.Tensor]  # a field's rows as int64: numpy on host rows, else torch
Ints = Union[Sequence[int], np.ndarray]  # slots, rooms or digests: a list, or a step's array


def _to_torch_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, HiddenStatesDtype):
        return TORCH_DTYPES[dtype]
    return getattr(torch, str(dtype))


def _env_flag(name: str) -> bool:
    """SGLang's EnvBool: true/1/yes/y, false/0/no/n (case-insensitive), unset = False; any
    other value warns and reads as the default (False), as SGLang's EnvField.get does."""
    value = os.environ.get(name)
    if value is None:
        return False
    lowered = value.lower()
    if lowered in ("true", "1", "yes", "y"):
        return True
    if lowered not in ("false", "0", "no", "n"):
        warnings.warn(f'Invalid value for {name}: "{lowered}" is not a valid boolean value, '
                      'using default "False"', stacklevel=1)  # the default, as SGLang's EnvField.get
    return False


def _as_i64(value: int) -> int:
    """The int64 with the same 8 bytes as the uint64 `value` (rooms are uint64 in SGLang)."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def _sglang_scalar(value: int) -> int:
    """What SGLang's `uint64_tensor[i] = value` accepts: torch unpacks the Python int as a
    signed 64-bit value, so 2**63 and above raise (SGLang's rooms are below 2**63)."""
    if not -(1 << 63) <= value < 1 << 63:
        raise ValueError("Overflow when unpacking long long")
    return value


def _placement(custom_mem_pool: Any, mem_pool: Optional[MemPoolType]) -> str:
    """SGLang's rule for where the rows live: a custom pool object means host memory, else
    `mem_pool` (else SGLANG_MOONCAKE_CUSTOM_MEM_POOL: INTRA_NODE_NVLINK means CUDA)."""
    if custom_mem_pool is not None:
        return Device.cpu.value
    pool = mem_pool
    if pool is None:
        env_pool = os.environ.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL")
        pool = MemPoolType.INTRA_NODE_NVLINK if env_pool == "INTRA_NODE_NVLINK" else MemPoolType.NONE
    return buffer_device(pool, Platform(cuda_devices=torch.cuda.device_count())).value


class _Stages(NamedTuple):
    """CUDA rows: the pinned staging of each per-step write (rooms and tags, tags, clears)."""

    rooms: PinnedStage
    sums: PinnedStage
    clear: PinnedStage


class MetadataBuffers:
    """SGLang 0.5.23's MetadataBuffers. Keyword-only extras say where the rows live and
    which layout they follow: `device` (else `mem_pool`, else SGLang's own rule: a custom
    pool object means host memory, SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK means
    CUDA), `enable_sampling_mask` (else SGLang's env SGLANG_ENABLE_DISAGG_SAMPLING_MASK) and
    `layout` (else conf/layout/sglang_0_5_23.yaml)."""

    # SGLang 0.5.23's fields, the attributes set_buf() writes: each layout field is one,
    # None where absent (set_buf then raises as SGLang's does)
    output_ids: torch.Tensor
    cached_tokens: torch.Tensor
    output_token_logprobs_val: torch.Tensor
    output_token_logprobs_idx: torch.Tensor
    output_top_logprobs_val: torch.Tensor
    output_top_logprobs_idx: torch.Tensor
    output_token_sampling_mask_len: torch.Tensor
    output_token_sampling_mask_idx: torch.Tensor
    output_token_sampling_logprobs: torch.Tensor
    output_topk_p: torch.Tensor
    output_topk_index: torch.Tensor
    output_hidden_states: torch.Tensor
    output_dsa_topk_indices: Optional[torch.Tensor]
    kv_checksum: Optional[torch.Tensor] = None  # also where the layout has no such field

    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: Any,
        max_sampling_mask_tokens: int,
        max_top_logprobs_num: int = 128,
        custom_mem_pool: Any = None,
        output_dsa_topk_indices_dim: int = 0,
        *,
        kv_checksum_enabled: bool = False,
        enable_sampling_mask: Optional[bool] = None,
        layout: Optional[Declaration] = None,
        mem_pool: Optional[MemPoolType] = None,
        device: Optional[torch.device | str] = None,
        pin_memory: bool = False,
    ):
        if size <= 0 or hidden_size <= 0:
            raise ValueError(f"size and hidden_size must be > 0, got {size}, {hidden_size}")
        global _DEFAULT_LAYOUT
        if layout is None:
            _DEFAULT_LAYOUT = _DEFAULT_LAYOUT or load_layout()
            layout = _DEFAULT_LAYOUT
        self.layout = layout
        self.custom_mem_pool = custom_mem_pool
        self.device = torch.device(_placement(custom_mem_pool, mem_pool) if device is None else device)
        self.size = size
        if enable_sampling_mask is None:
            enable_sampling_mask = _env_flag("SGLANG_ENABLE_DISAGG_SAMPLING_MASK")
        self.sizes = Sizes(hidden_size, _to_torch_dtype(hidden_states_dtype), max_sampling_mask_tokens,
                           max_top_logprobs_num, output_dsa_topk_indices_dim, kv_checksum_enabled,
                           bool(enable_sampling_mask))
        self.specs: list[FieldSpec] = field_specs(layout, self.sizes)
        self._carve(pin_memory)
        self.item_lens = [s.item_len for s in self.specs]
        self.room_field = next(i for i, s in enumerate(self.specs) if s.role == "room")
        self.checksum_field = next((i for i, s in enumerate(self.specs) if s.role == "checksum"), None)
        self._get_buf_names = get_buf_names(layout)
        self._views()

    # SGLang 0.5.23's two attributes that repeat constructor arguments: read from `sizes`, which
    # holds every argument the rows' shapes come from (one record, not two copies)
    @property
    def enable_sampling_mask(self) -> bool:
        return self.sizes.enable_sampling_mask

    @property
    def output_dsa_topk_indices_dim(self) -> int:
        return self.sizes.output_dsa_topk_indices_dim

    def _carve(self, pin_memory: bool) -> None:
        """The one backing allocation, and every present field as a (size, width) view into
        it, 256-byte aligned; an absent field is None, as in SGLang."""
        size = self.size
        offsets, total = [], 0
        for spec in self.specs:
            offsets.append(total)
            total += (size * spec.item_len + _ALIGN - 1) // _ALIGN * _ALIGN
        # The caching allocator hands out 512-byte aligned blocks; over-allocate to align.
        # On CUDA, a whole multiple of 2 MiB makes the arena its own cudaMalloc segment, so
        # its pointer is the allocation base that CUDA IPC (and Mooncake's NVLink
        # registration) hands to the peer.
        nbytes_arena = total + 2 * _ALIGN  # alignment slack, then the warm-up scratch
        if self.device.type == "cuda":
            nbytes_arena = -(-nbytes_arena // _CUDA_SEGMENT) * _CUDA_SEGMENT
        self._arena = torch.zeros(nbytes_arena, dtype=torch.uint8, device=self.device,
                                  pin_memory=pin_memory and self.device.type == "cpu")
        shift = (-self._arena.data_ptr()) % _ALIGN
        self.fields: list[torch.Tensor] = []
        self.offsets: list[int] = []  # of each field from arena_ptr
        for name in (f.name for f in self.layout.fields):
            setattr(self, name, None)  # absent fields are None, as in SGLang
        for spec, off in zip(self.specs, offsets):
            raw = self._arena[shift + off: shift + off + size * spec.item_len]
            tensor = raw.view(spec.dtype).view(size, spec.width)
            if spec.fill:
                tensor.fill_(spec.fill)
            self.fields.append(tensor)
            self.offsets.append(off)
            setattr(self, spec.name, tensor)
        self.arena = self._arena[shift: shift + total]  # the fields, as bytes
        # The fields and the scratch as one flat int64 view: the per-step writes of rooms,
        # digests and clears are one indexed kernel each over it (positions from
        # words_at), and a padded position can point into the scratch.
        self.words = self._arena[shift: shift + total + WARM_BYTES].view(torch.int64)

    def _views(self) -> None:
        """The room and kv_checksum rows as int64 (uint64 has few kernels, on CUDA especially):
        numpy arrays on host rows (no torch op per write), tensors on device rows, with pinned
        staging for their per-step writes there (no pageable copy; None: host rows)."""
        host = self.device.type == "cpu"
        rooms = self.fields[self.room_field].view(torch.int64)
        self._rooms: Rows64 = rooms.numpy() if host else rooms
        self._checksums: Optional[Rows64] = None
        if self.checksum_field is not None:
            sums = self.fields[self.checksum_field].view(torch.int64)
            self._checksums = sums.numpy() if host else sums
        self._stages: Optional[_Stages] = None
        if self.device.type == "cuda":
            self._stages = _Stages(PinnedStage(self.device), PinnedStage(self.device), PinnedStage(self.device))
        every = range(self.size)
        first = [self.words_at(self.room_field, every).reshape(self.size, 1)]
        rest = [self.words_at(self.room_field, every, range(1, self.item_lens[self.room_field] // 8))]
        if self.checksum_field is not None:
            first.append(self.words_at(self.checksum_field, every, (0, 1)).reshape(self.size, 2))
            rest.append(self.words_at(self.checksum_field, every, range(2, self.item_lens[self.checksum_field] // 8)))
        self.slot_words = np.concatenate(first + [r.reshape(self.size, -1) for r in rest], axis=1)
        """Per slot, the positions in `words` of its room row and kv_checksum row, which a
        freed slot has zeroed: first the words a seal writes (bootstrap_room[slot, 0], then
        kv_checksum[slot, 0:2] where the layout has it), then the rest of both rows. The
        hot path's indexed writes take their positions from here (no arithmetic per step)."""

    # Registered with the engine: the fields, then WARM_BYTES of scratch that no field covers.
    # A peer's first write into this registration is its warm-up (Mooncake opens the CUDA IPC
    # mapping or the TCP connection on a session's first write), so that one-time cost falls
    # in start-up, not on the first request.
    @property
    def arena_ptr(self) -> int:
        return self.arena.data_ptr()

    @property
    def arena_bytes(self) -> int:
        return self.arena.nbytes + WARM_BYTES

    @property
    def scratch_word(self) -> int:
        """Where the scratch starts in `words`: right after the fields."""
        return self.arena.nbytes // 8

    @property
    def scratch_ptr(self) -> int:
        return self.arena_ptr + self.arena.nbytes

    @property
    def row_bytes(self) -> int:
        """One request's row: every present field's item length."""
        return sum(self.item_lens)

    # ---- SGLang 0.5.23's surface --------------------------------------------------------
    def get_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data pointers, total byte lengths, one row's byte length) of the present fields."""
        ptrs = [t.data_ptr() for t in self.fields]
        lens = [t.nbytes for t in self.fields]
        return ptrs, lens, list(self.item_lens)

    def get_buf(self, idx: int) -> tuple[Optional[torch.Tensor], ...]:
        """Copies of row `idx`, one entry per get_buf field of the layout (14 for SGLang
        0.5.23), None where the field is absent."""
        out = []
        for name in self._get_buf_names:
            t = getattr(self, name)
            out.append(None if t is None else t[idx].clone())
        return tuple(out)

    def set_kv_checksum(self, req: Any, digest: int, signature: int) -> None:
        row = self._checksums[req.metadata_buffer_index]  # type: ignore[index]  # no field: raises, as SGLang's
        row[0] = _sglang_scalar(digest)
        row[1] = _sglang_scalar(signature)

    def get_kv_checksum(self, idx: int) -> tuple[int, int]:
        """(digest, signature); (0, 0) means no digest was written."""
        digest, signature = self._checksums[idx, :2].tolist()  # type: ignore[index]  # as set_kv_checksum
        return digest & _U64, signature & _U64

    def clear_slot(self, idx: int) -> None:
        """Zero the room row (and the kv_checksum row) a slot's next owner reads before its
        prefill writes them, so it sees "not yet written", not the previous owner's."""
        self._rooms[idx] = 0
        if self._checksums is not None:
            self._checksums[idx] = 0

    def set_buf(self, req: Any) -> None:
        """Write row req.metadata_buffer_index from a finished SGLang request, as SGLang
        0.5.23 does (field by field; absent fields raise as they would there)."""
        slot = req.metadata_buffer_index
        self.output_ids[slot][0] = req.output_ids[0]
        self.cached_tokens[slot][0] = req.cached_tokens
        self.cached_tokens[slot][1] = req.cached_tokens_device
        self.cached_tokens[slot][2] = req.cached_tokens_host
        self.cached_tokens[slot][3] = req.cached_tokens_storage
        image_t, audio_t, video_t = req.get_mm_token_counts()
        self.cached_tokens[slot][4] = image_t
        self.cached_tokens[slot][5] = audio_t
        self.cached_tokens[slot][6] = video_t
        if req.return_logprob:
            lp = req.logprob
            if lp.output_token_logprobs_val:
                self.output_token_logprobs_val[slot][0] = lp.output_token_logprobs_val[0]
            if lp.output_token_logprobs_idx:
                self.output_token_logprobs_idx[slot][0] = lp.output_token_logprobs_idx[0]
            if lp.output_top_logprobs_val:
                n = len(lp.output_top_logprobs_val[0])
                cap = self.output_top_logprobs_val.shape[1]
                if n > cap:
                    raise RuntimeError(
                        f"top_logprobs_num {n} exceeds disaggregation metadata capacity {cap}. "
                        "Lower top_logprobs_num or increase the metadata buffer.")
                self.output_top_logprobs_val[slot][:n] = torch.tensor(
                    lp.output_top_logprobs_val[0], dtype=torch.float32, device="cpu")
            if lp.output_top_logprobs_idx:
                n = len(lp.output_top_logprobs_idx[0])
                self.output_top_logprobs_idx[slot][:n] = torch.tensor(
                    lp.output_top_logprobs_idx[0], dtype=torch.int32, device="cpu")
        if req.return_sampling_mask:
            chunk = req.sampling_mask_rows.view()
            mask_len = len(chunk.token_ids)
            self.output_token_sampling_mask_len[slot][0] = mask_len
            self.output_token_sampling_mask_idx[slot, :mask_len].copy_(torch.from_numpy(chunk.token_ids))
            self.output_token_sampling_logprobs[slot, : len(chunk.logprobs)].copy_(
                torch.from_numpy(chunk.logprobs))
        if req.hidden_states_tensor is not None:
            topk = req.output_topk_p.size(0)
            self.output_topk_p[slot, :topk].copy_(req.output_topk_p)
            self.output_topk_index[slot, :topk].copy_(req.output_topk_index)
            self.output_hidden_states[slot].copy_(req.hidden_states_tensor)
            if self.output_dsa_topk_indices is not None:
                dsa = req.output_dsa_topk_indices
                if dsa is not None:
                    self.output_dsa_topk_indices[slot].copy_(dsa)
                else:
                    self.output_dsa_topk_indices[slot].fill_(-1)
        room = req.bootstrap_room
        self._rooms[slot, 0] = _sglang_scalar(room if room is not None else 0)

    # ---- what the orchestrator adds ---------------------------------------------------
    def room(self, slot: int) -> int:
        return int(self._rooms[slot, 0].item()) & _U64

    def words_at(self, field: int, slots: Ints, cols: Sequence[int] = (0,)) -> np.ndarray:
        """Positions in `words` of columns `cols` of field `field`'s 64-bit rows `slots`
        (slot-major: every column of the first slot, then the next)."""
        stride = self.item_lens[field] // 8
        base = self.offsets[field] // 8 + stride * np.asarray(slots, dtype=np.int64)
        return (base[:, None] + np.asarray(cols, dtype=np.int64)).reshape(-1)

    def write_rooms(self, slots: Ints, rooms: Ints, digests: Optional[Ints] = None, signature: int = 0) -> None:
        """bootstrap_room[slot, 0] = room for a batch of slots, and with `digests`
        kv_checksum[slot] = (digest, signature) too. Device rows: one upload from pinned
        memory and one indexed kernel for all of it, queued (no wait). Host rows take a
        step's arrays as they are (rooms as uint64, digests as int64)."""
        stages = self._stages
        if stages is None:
            if isinstance(rooms, np.ndarray):  # uint64: its int64 view is _as_i64 of each
                self._rooms[slots, 0] = rooms.astype(np.uint64).view(np.int64)  # type: ignore[assignment]  # host: numpy
            else:
                self._rooms[list(slots), 0] = [_as_i64(r) for r in rooms]  # type: ignore[assignment]  # host: numpy
            if digests is not None:
                self.write_checksums(slots, digests, signature)
            return
        if isinstance(rooms, np.ndarray):
            rooms = rooms.tolist()
        if isinstance(digests, np.ndarray):
            digests = digests.tolist()
        pos = [self.words_at(self.room_field, slots)]
        vals = [np.array([_as_i64(r) for r in rooms], dtype=np.int64)]
        if digests is not None:
            assert self.checksum_field is not None, "digests need the layout's checksum field"
            pos.append(self.words_at(self.checksum_field, slots, (0, 1)))
            pair = np.empty((len(slots), 2), dtype=np.int64)
            pair[:, 0] = [_as_i64(d) for d in digests]
            pair[:, 1] = _as_i64(signature)
            vals.append(pair.reshape(-1))
        n = sum(len(p) for p in pos)
        staged = stages.rooms.upload(np.concatenate(pos + vals))
        self.words.index_copy_(0, staged[:n], staged[n:])

    def write_checksums(self, slots: Ints, digests: Ints, signature: int) -> None:
        """kv_checksum[slot] = (digest, signature) for a batch of slots (device rows: queued;
        host rows take a step's int64 array of digests as it is)."""
        stages = self._stages
        if stages is None:
            if isinstance(digests, np.ndarray):  # int64: tags are below 2^63
                at = np.asarray(slots)
                self._checksums[at, 0] = digests  # type: ignore[index, assignment]  # host: numpy; no field: raises
                self._checksums[at, 1] = _as_i64(signature)  # type: ignore[index]
                return
            self._checksums[list(slots), :2] = [  # type: ignore[index, assignment]  # host: numpy; no field: raises
                [_as_i64(d), _as_i64(signature)] for d in digests]
            return
        vals = np.empty((len(slots), 2), dtype=np.int64)
        vals[:, 0] = digests if isinstance(digests, np.ndarray) else [_as_i64(d) for d in digests]
        vals[:, 1] = _as_i64(signature)
        assert self.checksum_field is not None, "digests need the layout's checksum field"
        pos = self.words_at(self.checksum_field, slots, (0, 1))
        staged = stages.sums.upload(np.concatenate([pos, vals.reshape(-1)]))
        self.words.index_copy_(0, staged[:len(pos)], staged[len(pos):])

    def clear_slots(self, slots: Sequence[int]) -> None:
        """clear_slot() for a batch. Device rows: one upload and one indexed kernel, queued:
        call sync() (a digest read syncs too) before the slots are granted again."""
        if not len(slots):
            return
        stages = self._stages
        if stages is None:
            self._rooms[slots] = 0
            if self._checksums is not None:
                self._checksums[slots] = 0
            return
        self.words.index_fill_(0, stages.clear.upload(self.slot_words[list(slots)].reshape(-1)), 0)

    def warm(self) -> None:
        """Runs each write kernel of the hot path once on device rows (their first launch
        loads them: milliseconds). Call only on fresh buffers: it writes zeros into the room
        and kv_checksum rows of slots 0 and 1, which hold zeros until the first request."""
        if self.device.type == "cpu":
            return
        two = [0, 1] if self.size > 1 else [0]
        for slots in ([0], two):
            self.write_rooms(slots, [0] * len(slots))
            if self._checksums is not None:
                self.write_checksums(slots, [0] * len(slots), 0)
            self.clear_slots(slots)
        self.room(0)
        self.sync()

    def row_snapshot(self, slot: int, skip: Iterable[int] = ()) -> bytes:
        """Row `slot` of every field (but `skip`), in field order, as host bytes (host rows)."""
        assert self.device.type == "cpu", "row snapshots read host memory"
        skip = set(skip)
        return b"".join(ctypes.string_at(t.data_ptr() + n * slot, n)
                        for i, (t, n) in enumerate(zip(self.fields, self.item_lens)) if i not in skip)

    def flip_byte(self, slot: int, field_index: int, offset: int = 0) -> None:
        """Fault injection (faults.kind=corrupt_byte): change one byte of one field's row."""
        self.fields[field_index][slot].view(torch.uint8)[offset] ^= 0x5A

    def sync(self) -> None:
        """Wait for this device's queued writes (before another engine reads the rows)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class PinnedStage:
    """A pinned host int64 buffer and its device twin: a step's small inputs (positions,
    values) go up with one non-blocking copy instead of a pageable one. The buffer is
    rewritten only once the copy from it has run (an event; by then the step's one wait has
    normally passed, so this does not block)."""

    def __init__(self, device: torch.device, n: int = 256):
        self.device = device
        self.event = torch.cuda.Event()
        self.used = False
        self._alloc(n)

    def _alloc(self, n: int) -> None:
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
        self.np = self.host.numpy()
        self.dev = torch.zeros(n, dtype=torch.int64, device=self.device)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        n = len(values)
        if self.used:
            self.event.synchronize()
        if n > len(self.np):
            self._alloc(max(n, 2 * len(self.np)))
        self.np[:n] = values
        dev = self.dev[:n]
        dev.copy_(self.host[:n], non_blocking=True)
        self.event.record()
        self.used = True
        return dev


class StagedRows:
    """buffers.set_buf=staged on device rows: SGLang's set_buf writes go to a pinned host
    copy of the rows (host-speed writes), and a step's rows go up in one copy, scattered to
    their slots by one kernel per field (orchestrator.handoff.digest's step graph). The copy holds
    what the device rows hold (both start equal, and only this process writes its rows), so
    the bytes that land are those SGLang's set_buf would have written."""

    def __init__(self, b: MetadataBuffers):
        s = b.sizes
        self.rows = MetadataBuffers(
            b.size, s.hidden_size, s.hidden_states_dtype, s.max_sampling_mask_tokens,
            s.max_top_logprobs_num, None, s.output_dsa_topk_indices_dim,
            kv_checksum_enabled=s.kv_checksum_enabled, enable_sampling_mask=b.enable_sampling_mask,
            layout=b.layout, device="cpu", pin_memory=b.device.type == "cuda")
        self.take(b)
        self.fields = [t.view(torch.uint8).numpy() for t in self.rows.fields]  # (size, item_len)
        self.cols = np.cumsum([0] + b.item_lens).tolist()  # a packed row: field f at cols[f]

    def set_buf(self, req: Any) -> None:
        self.rows.set_buf(req)

    def take(self, b: MetadataBuffers) -> None:
        """Take the device rows' content (a phase of staged fills starts after others
        wrote the device rows directly; start-up work, not per step)."""
        self.rows.arena.copy_(b.arena)

    def pack(self, slots: Sequence[int], out: np.ndarray) -> None:
        """The rows of `slots`, packed (field after field), into out[:len(slots)]."""
        idx = np.asarray(slots, dtype=np.int64)
        for f, rows in enumerate(self.fields):
            out[:len(idx), self.cols[f]:self.cols[f + 1]] = rows[idx]


class SlotAllocator:
    """Free rows of a MetadataBuffers. Slots are handed out in random order from a CSPRNG
    seed, so nobody can predict which row a request will land in; alloc_run() hands out
    consecutive slots (a coalesced send writes them as one block per field)."""

    def __init__(self, size: int, rng: Optional[random.Random] = None):
        self.size = size
        self._free = list(range(size))
        self._pos = list(range(size))  # slot -> index in _free, -1 when allocated
        self._mask = bytearray(b"\x01" * size)  # 1 where free: runs are found by bytes.find, in C
        self._rng = rng or random.Random(secrets.randbits(64))

    @property
    def available(self) -> int:
        return len(self._free)

    def take(self, slot: int) -> None:
        """Take this free slot (a TP follower takes the slot its leader granted)."""
        i = self._pos[slot]
        last = self._free.pop()
        if last != slot:
            self._free[i] = last
            self._pos[last] = i
        self._pos[slot] = -1
        self._mask[slot] = 0

    def alloc(self) -> Optional[int]:
        if not self._free:
            return None
        slot = self._free[self._rng.randrange(len(self._free))]
        self.take(slot)
        return slot

    def runs(self) -> list[tuple[int, int]]:
        """The free runs, (first slot, length), in slot order (two finds per run, not a
        Python pass over every slot)."""
        mask, out = self._mask, []
        i = mask.find(1)
        while i >= 0:
            j = mask.find(0, i)
            if j < 0:
                j = self.size
            out.append((i, j - i))
            i = mask.find(1, j)
        return out

    def alloc_run(self, n: int, start: Optional[int] = None) -> list[int]:
        """Up to `n` consecutive slots. From `start` when that slot is free (as many as are
        free from there); else a free run of at least n (one of them, at random), else the
        longest free run there is; [] when none is free."""
        if start is not None and 0 <= start < self.size and self._pos[start] >= 0:
            stop = min(start + max(n, 1), self.size)
            end = self._mask.find(0, start, stop)  # the first taken slot from start on
            slots = list(range(start, stop if end < 0 else end))
        else:
            runs = self.runs()
            if not runs:
                return []
            fits = [r for r in runs if r[1] >= n]
            if fits:
                begin, length = self._rng.choice(fits)
                begin += self._rng.randrange(length - n + 1)
                count = n
            else:
                begin, count = max(runs, key=lambda r: r[1])
            slots = list(range(begin, begin + count))
        pos, free = self._pos, self._free
        for slot in slots:  # take() of each, inline
            i = pos[slot]
            last = free.pop()
            if last != slot:
                free[i] = last
                pos[last] = i
            pos[slot] = -1
        if slots:
            self._mask[slots[0]:slots[-1] + 1] = bytes(len(slots))
        return slots

    def free(self, slot: int) -> None:
        self.free_many((slot,))

    def free_many(self, slots: Iterable[int]) -> None:
        """free() of each (a step's rows at once); ValueError at the first not allocated."""
        pos, free, mask, size = self._pos, self._free, self._mask, self.size
        for slot in slots:
            if not 0 <= slot < size or pos[slot] >= 0:
                raise ValueError(f"slot {slot} is not allocated")
            pos[slot] = len(free)
            free.append(slot)
            mask[slot] = 1
