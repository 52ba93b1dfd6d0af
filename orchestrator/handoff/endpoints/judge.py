"""How a decode rank reads its rows and judges them: Rows (the step's read pass, the
readiness gate's read of rooms, the zeroing of freed slots' rooms) and Judge (the readiness
gate and the verdict on one rank's row of a request)."""

from __future__ import annotations

import itertools
import time
from operator import attrgetter
from typing import Optional

import numpy as np
import torch

from orchestrator.handoff.buffers import MetadataBuffers, SlotAllocator
from orchestrator.handoff.digest import RowCheck, RowDigest, StepRead, pack_tag
from orchestrator.handoff.endpoints.decode_state import Grant
from orchestrator.handoff.specs import GateSpec
from orchestrator.profile.kinds import GateRead
from orchestrator.profile.plan import Device
from orchestrator.results.outcomes import Detail, KVPoll, Outcome
from orchestrator.results.records import DecodeResult

_CLEAN = attrgetter("status", "room", "pad", "tag")  # what Judge.clean reads of a grant
_SUCCESS = int(KVPoll.Success)
_SCALAR_MOST = 4  # Judge.clean: up to this many candidates compared one by one


class Rows:
    """This rank's rows as the step reads them, and the zeroing of freed slots' rooms
    (gate.zero_room_on_free).

    One rank reads as gate.read says (host rows: a plain read); a TP group's ranks read
    plainly (gate.read does not apply). Device rows queue a freed slot's zeroing with the next
    step's read pass and free the slot only after that pass's one wait (at most one wait a
    step): a pass of its own when that step reads nothing, which one rank runs when slots
    are wanted and a TP group's ranks in their next step, all of them (the same slots were
    freed on every rank, so each rank's allocator frees them in the same step). Host rows
    zero at the step's end and free at once."""

    def __init__(self, buffers: MetadataBuffers, digest: RowDigest, slots: SlotAllocator, mode: GateRead,
                 zero_on_free: bool):
        self.buffers, self.digest, self.slots, self.mode = buffers, digest, slots, mode
        self.zero_on_free = zero_on_free
        self.host_rows = buffers.device.type == Device.cpu.value
        self.defer_clears = not self.host_rows
        self.quarantine: list[int] = []  # freed, zeroed with the next read pass (defer_clears)
        self.to_clear: list[int] = []  # freed, zeroed at the step's end
        self.stream: Optional[torch.cuda.Stream] = None  # the step's device pass (None: the current one)
        if not self.host_rows and mode is GateRead.side_stream:
            self.stream = torch.cuda.Stream(buffers.device, priority=-1)

    def read_plain(self, cands: list[Grant]) -> list[Optional[RowCheck]]:
        """A TP rank's read: the rows of the requests with a status (None for the others),
        zeroing the quarantined slots in the same pass (a pass of its own when none has a
        status)."""
        have = [g for g in cands if g.status is not None]
        if not have:
            if self.quarantine:
                self.clear_pass()
            return [None] * len(cands)
        cleared, self.quarantine = self.quarantine, []
        rows = self.digest.read([g.slot for g in have], [(g.prank, g.rid) for g in have], clear=cleared)
        self._release(cleared)  # zeroed in the read's pass, covered by its wait
        got = {id(g): r for g, r in zip(have, rows)}
        return [got.get(id(g)) for g in cands]

    def read_pass(self, cands: list[Grant], t0: float
                  ) -> tuple[list[RowCheck], Optional[dict[int, int]], float, float]:
        """read_step, a RowCheck per candidate."""
        step, taken_at, gate_s, stall_s = self.read_step(cands, t0)
        return step.checks(), taken_at, gate_s, stall_s

    def read_step(self, cands: list[Grant], t0: float
                  ) -> tuple[StepRead, Optional[dict[int, int]], float, float]:
        """One rank's read (every candidate has a status), zeroing the quarantined slots in
        the same pass: the rows (as arrays), when the sglang gate took each (else None), the
        gate's read and the loop's stall since `t0` (perf_counter seconds)."""
        taken_at = self._sglang_gate(cands) if self.mode is GateRead.sglang and not self.host_rows else None
        t_pass = time.perf_counter()
        cleared, self.quarantine = self.quarantine, []
        step = self.digest.read_step([g.slot for g in cands], [(g.prank, g.rid) for g in cands], clear=cleared,
                                     stream=self.stream)
        self._release(cleared)  # zeroed in the read's pass, covered by its wait
        t_end = time.perf_counter()
        return step, taken_at, ((t_pass - t0) if taken_at is not None else (t_end - t_pass)), t_end - t0

    def _sglang_gate(self, cands: list[Grant]) -> dict[int, int]:
        """gate.read=sglang on device rows: SGLang 0.5.23's `_apply_metadata_gate`, one
        `bootstrap_room[idx, 0].item()` per ready request on the current stream (each a device
        sync, behind whatever is queued there). Returns when each was taken (ns); the verdict
        still comes from the step's digest pass."""
        out = {}
        for g in cands:
            self.buffers.room(g.slot)
            out[g.slot] = time.monotonic_ns()
        return out

    def clear_pass(self) -> None:
        """Zero the quarantined slots' rooms and free them once that landed (one wait)."""
        with torch.cuda.stream(self.stream or torch.cuda.current_stream(self.buffers.device)):
            cleared = self._queue_clears()
            self.buffers.sync()
        self._release(cleared)

    def _queue_clears(self) -> list[int]:
        """Queue the zeroing of the quarantined slots (device rows: no wait here)."""
        cleared, self.quarantine = self.quarantine, []
        if cleared:
            self.buffers.clear_slots(cleared)
        return cleared

    def _release(self, cleared: list[int]) -> None:
        for slot in cleared:
            self.slots.free(slot)

    def free(self, slot: int) -> None:
        """A judged or released request's slot: free now, at the step's end, or after the
        next read pass (see the class)."""
        self.free_many([slot])

    def free_many(self, slots: list[int]) -> None:
        """free() of each (a step's verified requests' slots at once)."""
        if self.zero_on_free and self.defer_clears:
            self.quarantine += slots
            return
        if self.zero_on_free:
            self.to_clear += slots
        self.slots.free_many(slots)

    def zero_freed(self) -> None:
        """End of a step, host rows: zero the rooms of the slots freed in it (device rows
        hold theirs until the next pass has zeroed them: a freed slot is granted only after
        that pass's wait, so the next owner's row, written by the prefill's engine outside
        this process's stream, never lands before the zero does)."""
        if self.to_clear:
            self.buffers.clear_slots(self.to_clear)
            self.to_clear = []


class Judge:
    """The judging rules, on one rank's row of a request; a TP group's ranks each judge their
    own and agree (orchestrator.handoff.endpoints.tp)."""

    def __init__(self, gate: GateSpec, timeout_s: float, buffers: MetadataBuffers, digest: RowDigest,
                 res: DecodeResult):
        self.buffers, self.digest, self.res = buffers, digest, res
        self.timeout_s = timeout_s  # transport.timeout_s
        self.never_landed_s = gate.never_landed_s or timeout_s  # (null: the timeout)
        self.readiness = gate.readiness
        self.settle_s = gate.settle_ms / 1e3

    def poll(self, g: Grant, r: Optional[RowCheck], now: float) -> int:
        """This rank's KVPoll of a request: Transferring with no status yet (no row read) or
        while the readiness gate holds its row, Failed as its sender said, else Success."""
        if r is None:
            return int(KVPoll.Transferring)
        if g.status == KVPoll.Failed:
            return int(KVPoll.Failed)
        if self.unready(g, r, now):  # the gate: "done", but this row has not landed
            return int(KVPoll.Transferring)
        return int(KVPoll.Success)

    def verdict(self, g: Grant, r: Optional[RowCheck], agreed: int, now: float) -> Optional[tuple[Outcome, Detail]]:
        """The verdict on a request polled `agreed` (a TP group: every rank's MIN), None while
        it waits: Failed fails it (a sender error, or another rank's: TP divergence); Success
        judges the row; "done" with the room still 0 past gate.never_landed_s (default
        transport.timeout_s) fails it."""
        if agreed == KVPoll.Failed:
            return Outcome.failed, Detail.sender_error if g.status == KVPoll.Failed else Detail.tp_disagreement
        if agreed == KVPoll.Success:  # taken (the gate passed); the verdict once the digest is compared
            return self.judge(g, r)
        if r is not None and r.room == 0 and now - g.t_status > self.never_landed_s:
            return Outcome.failed, Detail.room_never_landed
        return None

    def unready(self, g: Grant, r: RowCheck, now: float) -> bool:
        """The readiness gate (gate.readiness): "done" still counts as "transferring" while
        the row's room is 0 (SGLang's fix), and, within gate.settle_ms of the status, while
        the room is right but the digest is not yet (a torn row: the room block landed
        before the others). Past the window the row is judged: corrupted."""
        if not self.readiness:
            return False
        if r.room == 0:
            return True
        if self.settle_s and r.room == g.room and now - g.t_status < self.settle_s \
                and not self._digest_ok(g, r):
            if not g.settling:
                g.settling = True
                self.res.settled += 1
            return True
        return False

    def clean(self, cands: list[Grant], step: StepRead) -> list[bool]:
        """Which candidates this step verifies outright: a success status, the request's
        own room landed, and the tag its row's sums give under its pad is the one that
        landed (or that its status carried). Whatever the gate's settings, poll() takes such
        a row and judge() verifies it; every other row is judged one by one. A few
        candidates are compared one by one in Python (pack_tag's arithmetic), more as arrays
        (StepRead.expected_tags): the same test either way."""
        k = len(cands)
        if k <= _SCALAR_MOST:
            rooms = step.rooms.tolist()
            landed = (step.tags.tolist() if self.buffers.checksum_field is not None
                      else [g.tag for g in cands])
            keyed = step.c[:, 0].tolist() if step.blake else [
                pack_tag(c0, c1, g.pad) for g, (c0, c1) in zip(cands, step.c[:, :2].tolist())]
            return [g.status == _SUCCESS and room == g.room and room != 0 and tag == want
                    for g, room, tag, want in zip(cands, rooms, landed, keyed)]
        status, room, pad, tag = zip(*map(_CLEAN, cands))
        ok = (np.fromiter(status, dtype=np.int64, count=k) == _SUCCESS if None not in status
              else np.fromiter((s == _SUCCESS for s in status), dtype=bool, count=k))  # (None: no status)
        rooms_a = np.fromiter(room, dtype=np.uint64, count=k)
        pads = np.fromiter(itertools.chain.from_iterable(pad), dtype=np.int64, count=2 * k).reshape(k, 2)
        landed_a = (step.tags if self.buffers.checksum_field is not None
                    else np.fromiter(tag, dtype=np.uint64, count=k))
        return (ok & (step.rooms == rooms_a) & (rooms_a != 0)
                & (step.expected_tags(pads[:, 0], pads[:, 1]) == landed_a)).tolist()

    def _digest_ok(self, g: Grant, r: RowCheck) -> bool:
        landed = r.landed_tag if self.buffers.checksum_field is not None else g.tag
        return self.digest.expected_tag(r, g.pad) == landed

    def judge(self, g: Grant, r: Optional[RowCheck]) -> tuple[Outcome, Detail]:
        if r is None:  # agreed by the group, never seen here (TP divergence)
            return Outcome.failed, Detail.tp_disagreement
        if r.room == 0:  # taken before its row landed: what a decode without the gate does
            return Outcome.corrupted, Detail.taken_unready
        if r.room != g.room:
            return Outcome.corrupted, Detail.room_mismatch
        if not self._digest_ok(g, r):
            if (self.buffers.checksum_field is not None and g.tag
                    and r.landed_tag not in (0, g.tag)):  # not the tag its sender wrote, nor none
                return Outcome.corrupted, Detail.written_by_someone_else
            return Outcome.corrupted, Detail.checksum_mismatch
        return Outcome.verified, Detail.none

