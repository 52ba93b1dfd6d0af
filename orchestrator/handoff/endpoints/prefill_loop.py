"""The prefill's main loop, one phase of it: requests arrive, are announced to their decode
instance, take a slot when it grants one, are filled and sealed a forward step at a time, and
sent: a step alone in flight by the loop itself (run to completion: its write, completion
and status with no thread hop), steps that overlap by the transfer thread where the loops spin
(a host of 8 cores or more) or a write's completion cannot be asked without waiting, else by
the loop too (each write finished in the pass after it started, once landed); verdicts come
back in batches. The loop owns the phase; it reaches the decodes through Links, its rows
through SourceRows, its sends through the Sender, and nothing else of the endpoint."""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import time
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Callable, Optional, Sequence, cast

import structlog
import zmq

from orchestrator.handoff.backends.base import Send, Transfer
from orchestrator.handoff.buffers import MetadataBuffers, SlotAllocator, StagedRows
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.endpoints import control
from orchestrator.handoff.endpoints.common import Shutdown, heartbeat_s, rss_kb
from orchestrator.handoff.endpoints.links import Instance, Link, Links, Req
from orchestrator.handoff.endpoints.sender import ForwardStep, Sender
from orchestrator.handoff.faults import LoopFaults
from orchestrator.handoff.specs import PrefillSpec, WorkloadSpec
from orchestrator.handoff.transport import wire
from orchestrator.handoff.workload import RequestPool, arrival_offsets, decode_of, request_rooms, seed_of
from orchestrator.profile.kinds import FillMode, SetBufMode, StatusMode
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.outcomes import DETAIL_OF, OUTCOME_OF, Detail, Outcome
from orchestrator.results.records import Finished, RankResult
from orchestrator.results.rundir import RunFile

ISSUE_BUDGET = 4096  # arrivals per pass of the loop (see PrefillLoop.issue)
HEAR_MS = 50  # the longest the loop waits in its poll


@dataclass
class PhaseSpec:
    """One timed run of the workload (a plain run has one; the benchmark several)."""

    requests: int
    concurrency: int
    rate: Optional[float] = None
    batch_size: int = 1
    fill: FillMode = FillMode.inline
    coalesce: bool = False
    status: StatusMode = StatusMode.per_request
    rid_base: int = 0  # request ids of this phase start here (unique per prefill rank)
    set_buf: SetBufMode = SetBufMode.sglang
    duration_s: Optional[float] = None  # arrivals stop this long after the phase began
    burstiness: float = 1.0  # open loop: the gamma shape of the gaps (1: Poisson)

    @classmethod
    def of(cls, spec: PrefillSpec, rank: int) -> "PhaseSpec":
        """The configured workload (workload.*, transport.coalesce and .status, buffers.set_buf)."""
        w = spec.workload
        return cls(w.requests, w.concurrency, w.rate, w.batch_size, w.fill, spec.coalesce, spec.status,
                   rid_base=rank * w.requests, set_buf=spec.set_buf, duration_s=w.duration_s,
                   burstiness=w.burstiness)


@dataclass
class SourceRows:
    """This rank's rows and what a step does with them: the free source slots, the
    synthetic requests that fill them, the digest that seals them, the pads' keys, the
    pinned staging rows (device rows), and whether the engine orders a step's writes."""

    buffers: MetadataBuffers
    src: SlotAllocator
    pool: RequestPool
    digest: RowDigest
    keys: Keys
    staged: Optional[StagedRows]
    engine_orders_writes: bool

    def fill_ahead(self) -> None:
        """workload.fill=ahead: every slot's row once, from a distinct synthetic request."""
        for slot in range(self.buffers.size):
            self.buffers.set_buf(self.pool.get(slot, slot))
        self.buffers.sync()
        self.digest.freeze()


@dataclass
class LoopSettings:
    """What a phase's loop knows of its rank: the rank, its workload (rooms, seed),
    the route's name for its records, transport.max_inflight_blocks, its records file, the
    memory figures it adds to, its log."""

    rank: int
    workload: WorkloadSpec
    route: str
    max_inflight_blocks: int
    records_path: Path
    memory: dict[str, int]
    log: structlog.stdlib.BoundLogger


class Book:
    """A phase's records as its loop keeps them: the requests finished since the last flush,
    counted into the phase's RankResult and appended to requests.jsonl in one go, column by
    column (flush: no record object per request); the process's memory sampled once `warm`
    requests are finished. `labels`: a fault's name for each request of a batch it hit."""

    def __init__(self, res: RankResult, path: Path, labels: Callable[[Sequence[int]], list[Optional[str]]],
                 memory: dict[str, int], warm: int):
        self.res, self.labels, self.memory, self.warm = res, labels, memory, warm
        self.sink = RunFile(path, "a", buffering=1 << 16)  # NoSpace names it
        self.done: list[Req] = []  # finished, not yet counted and written
        self.count = 0

    def add_many(self, reqs: list[Req]) -> None:
        """Finished requests, counted and written at the next flush (the process's memory is
        sampled once `warm` are in)."""
        self.done += reqs
        before, self.count = self.count, self.count + len(reqs)
        if before < self.warm <= self.count:
            self.memory["rss_kb_warm"] = rss_kb()

    def flush(self) -> None:
        if self.done:
            done, self.done = self.done, []
            cols = finished_columns(done, self.labels)
            self.res.add_finished(cols)
            self.sink.write(cols.lines(self.sink.tag))

    def close(self) -> None:
        self.sink.close()


class PrefillLoop:
    """The main loop of one phase (kept apart so the endpoint's set-up is reusable)."""

    def __init__(self, links: Links, rows: SourceRows, sender: Sender, settings: LoopSettings,
                 phase: PhaseSpec, conn: Optional[control.Pipe], faults: LoopFaults):
        self.links, self.rows, self.sender, self.settings = links, rows, sender, settings
        self.phase, self.conn, self.faults = phase, conn, faults
        w = settings.workload
        self.total = phase.requests
        self.offsets = arrival_offsets(phase.rate, w.seed, phase.requests, settings.rank, phase.burstiness,
                                       phase.duration_s)
        if self.offsets is not None:  # (with a duration: the arrivals it holds)
            self.total = len(self.offsets)
        self.res = RankResult(settings.rank, self.total, row_bytes=rows.buffers.row_bytes)
        # a closed loop's workload.duration_s: the clock (set at the start) that ends its arrivals
        self.deadline: Optional[float] = None
        if phase.duration_s is not None:
            hit = self.offsets is not None and self.total == phase.requests
            self.res.ended_by = "requests" if hit else "duration"
        self.outstanding: dict[int, Req] = {}
        self.ready: collections.deque[Req] = collections.deque()
        self.next_i = 0
        self.finished = 0
        self.stopping = False
        self.more_now = False  # issue() stopped at its budget with arrivals due now
        self.book = Book(self.res, settings.records_path, faults.labels, settings.memory, min(1000, self.total // 10))
        self.judged_unsent = 0  # verdicts in for requests whose send has not finished
        ranks = max(len(inst.links) for inst in links.instances)
        self.blocks_per_request = len(rows.buffers.specs) * ranks  # one block per field per rank
        self.blocks_out = sender.blocks_done  # blocks handed to the engine so far
        self.staged = rows.staged if phase.set_buf is SetBufMode.staged else None
        # requests' rooms and pads, from what is constant over the phase (request_rooms', Keys.pads')
        self.rid_base = phase.rid_base
        self.rooms_of = functools.partial(request_rooms, seed_of(w), w.duplicate_rooms)
        self.pads_of = functools.partial(rows.keys.pads, settings.rank)
        if self.staged is not None:
            self.staged.take(rows.buffers)  # earlier phases may have written the device rows

    # ---- request lifecycle ------------------------------------------------------------------
    def arrive(self, i: int, t_arrive: float, n: int = 1) -> None:
        """Requests i .. i+n-1 arrive at `t_arrive` (their rooms and pads taken together)."""
        instances, outstanding = self.links.instances, self.outstanding
        rids = range(self.rid_base + i, self.rid_base + i + n)
        for rid, room, pad in zip(rids, self.rooms_of(rids), self.pads_of(rids)):
            inst = instances[decode_of(rid, len(instances))]
            req = Req(rid, room, inst.index, t_arrive, pad)
            if inst.lost:
                req.verdict = (Outcome.failed, Detail.not_sent_peer_lost, None)
                self.finish(req, _clock())
                continue
            outstanding[rid] = req
            inst.backlog.append(req)

    def flush_arrivals(self) -> None:
        """Announce arrivals, at most as many ungranted at a time as the decode has slots
        (the rest wait here, their latency still counted from arrival)."""
        for inst in self.links.instances:
            while inst.backlog and inst.ungranted < inst.slots:
                req = inst.backlog.popleft()
                if req.verdict is not None:
                    continue
                inst.owed += 1
                inst.ungranted += 1
                inst.announce.append([req.rid, req.room])
            if inst.announce:
                if not inst.owed - len(inst.announce):
                    inst.last_heard = _clock()  # nothing was owed before: the clock starts now
                self.links.send(inst, wire.arrive_frame(inst.announce, self.phase.coalesce))  # (an ArriveMsg)
                inst.announce = []

    def form_step(self) -> bool:
        """One forward step: fill (inline) and seal the step's rows, hand its sends over.
        Device rows: the seal is one graph replay and the step waits at most once (the
        engine's own wait where it orders our writes, else one stream sync). The step's
        request ids, rooms, pads, slots and instances are taken once, as lists. Whether the
        step is alone in flight (no other request outstanding)."""
        rows, ph = self.rows, self.phase
        b, src = rows.buffers, rows.src
        k = min(ph.batch_size, len(self.ready), src.available)
        if ph.coalesce:
            slots = src.alloc_run(k)
        else:
            slots = [s for _ in range(k) if (s := src.alloc()) is not None]  # k <= available: all are
        ready = self.ready
        reqs = [ready.popleft() for _ in slots]
        rids, rooms, pads, dsts, insts = zip(*map(_STEP, reqs))
        t_step = _clock()
        staged = self.staged if ph.fill is FillMode.inline else None
        set_buf_us = self._fill(staged or b, rids, slots) if ph.fill is FillMode.inline else None
        rank = self.settings.rank
        # the sends first: the seal's device call and the write's follow each other closely
        work = self._work(rids, rooms, slots, dsts, insts)
        sealed = rows.digest.seal(slots, rooms, pads, [(rank, rid) for rid in rids], rows=staged,
                                  ahead=ph.fill is FillMode.ahead)
        if staged is not None and set_buf_us is not None:  # each request's share of packing the step's rows
            share = sealed.pack_s * 1e6 / len(reqs)
            set_buf_us = [us + share for us in set_buf_us]
        if not rows.engine_orders_writes:
            b.sync()
        if set_buf_us is not None:
            for req, us in zip(reqs, set_buf_us):
                req.set_buf_us = us
        self.blocks_out += sum(len(sends) * len(link.router.item_lens) for link, _, sends in work)
        step = ForwardStep(reqs, work, sealed=sealed)
        if sealed.ready:  # host rows: the tags are known now
            step.take_seal()
        t_ready, route = _clock(), self.settings.route
        for req, slot in zip(reqs, slots):
            req.src_slot, req.t_step, req.t_ready, req.route = slot, t_step, t_ready, route
        # alone in flight (no other request outstanding): the loop sends it itself, no hop
        alone = len(self.outstanding) == len(reqs)
        self.sender.submit(step, alone)
        return alone

    def _fill(self, target: MetadataBuffers | StagedRows, rids: Sequence[int], slots: Sequence[int]) -> list[float]:
        """workload.fill=inline: each request's row by SGLang's set_buf, timed one by one (us)."""
        pool, pc, out = self.rows.pool, time.perf_counter, []
        for rid, slot in zip(rids, slots):
            r = pool.get(rid, slot)
            t0 = pc()
            target.set_buf(r)
            out.append((pc() - t0) * 1e6)
        return out

    def _work(self, rids: Sequence[int], rooms: Sequence[int], slots: Sequence[int], dsts: Sequence[int],
              insts: Sequence[int]) -> list[tuple[Link, list[Transfer], list[Send]]]:
        """A step's sends per decode process: its requests' transfers (one per request and
        process of its instance), grouped by the process's send path."""
        cols: dict[int, tuple[Sequence[int], ...]]
        if insts.count(insts[0]) == len(insts):  # one decode instance (a step usually is)
            cols = {insts[0]: (rids, rooms, slots, dsts)}
        else:
            at: dict[int, list[int]] = {}
            for i, x in enumerate(insts):
                at.setdefault(x, []).append(i)
            cols = {x: tuple([c[i] for i in idx] for c in (rids, rooms, slots, dsts)) for x, idx in at.items()}
        ph, instances, work = self.phase, self.links.instances, []
        for x, (r, m, s, d) in cols.items():
            for link in instances[x].links:
                transfers = list(map(Transfer, r, m, s, d))
                work.append((link, transfers, link.router.sends(transfers, ph.coalesce, ph.status)))
        return work

    def pump(self, before: Optional[float] = None) -> int:
        """The sends the loop drives itself: finished in order with their statuses (those
        started before `before`, where given); the steps finished (by it or by the transfer
        thread) taken. The milliseconds the loop may then wait in its poll: none while its
        sends wait to be finished, at most one while a fault holds them back, else the loop's
        longest."""
        sender = self.sender
        finished = sender.pump(before)
        self.take_sent()
        if sender.deferred:
            return 0
        return (0 if finished else 1) if sender.busy else HEAR_MS

    def take_sent(self) -> None:
        """The steps whose sends finished, by the loop or by the transfer thread."""
        sender = self.sender
        if sender.error:
            raise RuntimeError(f"transfer thread failed: {sender.error}")
        while sender.done:
            self.sent(sender.done.popleft())

    def sent(self, step: ForwardStep) -> None:
        """A step's sends finished: free its source slots, note send times (a request's
        latest send's, where it went to several decode processes); finish the requests
        judged while their sends were out."""
        res, reqs = self.res, step.reqs
        by_rid = {r.rid: r for r in reqs} if len(step.sends) > 1 else None
        for _, send in step.sends:
            res.sends += 1
            res.send_blocks += send.blocks
            lat, t_status = send.latency_us, send.t_status
            landed = send.t0 + lat / 1e6
            for req in (map(by_rid.__getitem__, [t.rid for t in send.transfers]) if by_rid else reqs):
                if req.send_us is None or lat > req.send_us:
                    req.send_us = lat
                if landed > req.t_landed:
                    req.t_landed = landed
                if t_status > req.t_status_out:
                    req.t_status_out = t_status
        self.rows.src.free_many([req.src_slot for req in reqs])
        judged = []
        for req in reqs:
            req.sent = True
            if req.verdict is not None:
                if not req.done:
                    self.judged_unsent -= 1
                judged.append(req)
        if judged:
            self.finish_many(judged, _clock())

    def judged(self, inst: Instance, verdicts: wire.Rows) -> None:
        """Verdicts are taken only for a request in the state that expects one: judged
        (verified, corrupted or failed) once this prefill submitted its row's send (its status
        goes out behind the write); failed unsent only while it waits for a slot (the decode
        shed it). Anything else is counted and changes nothing."""
        now = _clock()
        res, get, index, same_clock = self.res, self.outstanding.get, inst.index, inst.same_clock
        failed, outcome_of, detail_of = Outcome.failed, OUTCOME_OF.get, DETAIL_OF.get
        done: list[Req] = []  # finished by their verdict (together, below)
        for rid, outcome, detail, t_ns, t_status_ns, t_taken_ns in verdicts:
            req = get(rid)
            if req is None or req.inst != index or req.verdict is not None:
                res.rejected += 1  # not ours, or judged twice (late, after a stop or a loss)
                continue
            o, d = outcome_of(outcome), detail_of(detail)
            if o is None or d is None:
                res.rejected += 1
                continue
            if (req.src_slot < 0 if req.dst_slot >= 0 else o is not failed):
                res.replayed += 1  # a verdict for a row not sent yet
                self.settings.log.warning("verdict_out_of_state", rid=rid, granted=req.dst_slot >= 0,
                                          outcome=o.value)
                continue
            if same_clock:
                req.verdict = (o, d, t_ns / 1e9)
                req.t_status_in = t_status_ns / 1e9
                req.t_taken = t_taken_ns / 1e9 if t_taken_ns else 0.0
            else:
                req.verdict = (o, d, now)
            inst.owed -= 1
            if req.dst_slot < 0:
                inst.ungranted -= 1
            if req.sent or req.src_slot < 0:
                done.append(req)
            else:  # judged before its send finished (a held send may go now)
                self.judged_unsent += 1
                for link in inst.links:
                    link.router.judged(rid)
        self.finish_many(done, now)

    def finish(self, req: Req, now: float) -> None:
        """A judged request is done (`now`: the clock at its verdict): its record is written
        with the others of this pass (flush_records)."""
        self.finish_many([req], now)

    def finish_many(self, reqs: list[Req], now: float) -> None:
        """finish() of each (a batch of verdicts)."""
        pop, fresh = self.outstanding.pop, []
        for req in reqs:
            if req.done:
                continue
            req.done = True
            assert req.verdict is not None, "finished once judged"
            req.t_done = now
            pop(req.rid, None)
            fresh.append(req)
        self.book.add_many(fresh)
        self.finished += len(fresh)

    def flush_records(self) -> None:
        """The requests finished since the last flush, counted and written in one go (once a
        pass of the loop, not per request)."""
        self.book.flush()

    def lose(self, inst: Instance, detail: Detail, why: str) -> None:
        """Fail everything an instance still owes us, now: a write to it may stay in the
        engine's hands until the engine gives up on the host (its source row is freed when
        the write returns; the record does not wait for it)."""
        inst.lost = True
        self.res.lost[inst.index] = why
        self.settings.log.error("peer_lost", decode=inst.index, detail=why, owed=inst.owed)
        now = _clock()
        for req in list(self.outstanding.values()):
            if req.inst == inst.index and req.verdict is None:
                req.verdict = (Outcome.failed, detail, None)
                self.finish(req, now)
        self.ready = collections.deque(r for r in self.ready if r.inst != inst.index)
        inst.backlog.clear()
        inst.owed = inst.ungranted = 0

    # ---- the loop -----------------------------------------------------------------------
    def _begin(self) -> float:
        """The phase's start: rows filled ahead where asked, the clocks set; returns t0."""
        if self.phase.fill is FillMode.ahead:
            self.rows.fill_ahead()
        t0 = _clock()
        self.res.t_start = t0
        if self.phase.duration_s is not None and self.offsets is None:
            self.deadline = t0 + self.phase.duration_s
        self.res.clock = "one_way" if all(i.same_clock for i in self.links.instances) else "round_trip"
        for inst in self.links.instances:
            inst.last_heard = t0
        return t0

    def _finish(self) -> RankResult:
        """The phase's end: memory and dropped frames into the result, the records file closed."""
        memory = self.settings.memory
        memory["rss_kb_end"] = rss_kb()
        self.res.memory = dict(memory)
        self.res.rejected += self.links.dropped.rejected
        self.res.replayed += self.links.dropped.replayed
        self.book.close()
        return self.res

    def run(self) -> RankResult:
        links, sender = self.links, self.sender
        t0 = self._begin()
        last_progress = last_iter = t0
        conn_fd = self.conn.fileno() if self.conn is not None else None
        if conn_fd is not None:
            links.poller.register(conn_fd, zmq.POLLIN)
        try:
            while self.finished < self.total:
                now = _clock()
                if now - last_iter > links.timeout_s / 2:  # WE were stalled: nobody owed us anything
                    for inst in links.instances:
                        inst.last_heard = now
                last_iter = now
                self.issue(now, t0)
                # Sends the loop drives (Sender): the writes of earlier passes first, landed
                # meanwhile (asked without waiting; one not landed yet is left for a later
                # pass), their statuses out. The writes of steps that overlap, started in this
                # pass, wait until the loop has heard its sockets: finished in the next pass,
                # or below when nothing came. A step alone in flight runs to completion here.
                sender.pump(now)
                overlapping = False
                while self.can_form():
                    overlapping |= not self.form_step()
                wait = min(self.pump(now if overlapping else None), self.wait_ms(now, t0))
                if wait:
                    # set before looking at sender.done: either the transfer thread sees the
                    # flag after it appends a step, or this loop sees the step (no lost wake)
                    sender.want_wake(self.waits_for_sender())
                    if sender.done:
                        wait = 0
                events = links.poll(wait)
                if not events and sender.deferred:
                    self.pump()  # nothing else to do: the writes left above
                if links.wake in events:
                    links.drain_wake()
                self.take_sent()
                for inst in links.instances:
                    if inst.control in events:
                        self.drain(inst)
                if self.conn is not None and conn_fd in events and self.conn.poll():
                    self.from_runner()
                if Shutdown.requested and not self.stopping:
                    self.stop(Detail.interrupted)
                now = _clock()
                self.silent_decodes(now)
                self.keepalive(now)
                self.flush_records()  # before a process fault may strike at this count
                self.faults.progress(self.finished, len(self.outstanding))
                if self.conn is not None and now - last_progress >= 0.25:
                    self.conn.send(control.Progress(finished=self.finished, verified=self.res.verified))
                    last_progress = now
        finally:
            self.flush_records()
            if conn_fd is not None:
                links.poller.unregister(conn_fd)
        return self._finish()

    def from_runner(self) -> None:
        """A message from the runner: stop, or a decode instance is gone (it saw it exit)."""
        assert self.conn is not None, "a runner to hear from"
        match self.conn.recv():
            case control.Stop():
                self.stop(Detail.interrupted)
            case control.DecodeGone(index=index, why=why):
                inst = self.links.instances[index]
                if not inst.lost:
                    self.lose(inst, Detail.decode_lost, why)

    def silent_decodes(self, now: float) -> None:
        """A decode instance that owes answers and sent nothing for transport.timeout_s is lost."""
        timeout_s = self.links.timeout_s
        for inst in self.links.instances:
            if not inst.lost and inst.owed > 0 and now - inst.last_heard > timeout_s:
                self.drain(inst)  # whatever already arrived counts first
                if inst.owed > 0 and now - inst.last_heard > timeout_s:
                    self.lose(inst, Detail.peer_lost,
                              f"decode silent for transport.timeout_s={timeout_s:g}")

    def keepalive(self, now: float) -> None:
        """An empty arrive to every live instance told nothing for a heartbeat interval."""
        links = self.links
        every = heartbeat_s(links.timeout_s)
        for inst in links.instances:
            if not inst.lost and now - inst.told >= every:
                links.send(inst, wire.encode(wire.ArriveMsg(reqs=[], contiguous=self.phase.coalesce)))

    def end_arrivals(self) -> None:
        """A closed loop's workload.duration_s ran out: what arrived is the phase's count."""
        self.deadline = None
        self.total = self.res.requests = self.next_i

    def issue(self, now: float, t0: float) -> None:
        if self.stopping:
            return
        if self.deadline is not None and now >= self.deadline:
            self.end_arrivals()
        holds = self.faults.holds
        # at most ISSUE_BUDGET arrivals per pass: with a decode lost, each fails at once and the
        # rest of the phase would pass here without the loop reporting progress to the runner
        end = min(self.total, self.next_i + ISSUE_BUDGET)
        if self.offsets is None:
            # as many as may arrive now, together (each one as long as no fault holds it)
            while (n := min(end - self.next_i, self.phase.concurrency - len(self.outstanding))) > 0:
                k = 0
                while k < n and not holds(self.next_i + k):
                    k += 1
                if k:
                    self.arrive(self.next_i, now, k)
                    self.next_i += k
                if k < n:  # held
                    break
            self.more_now = self.next_i == end < self.total
            if self.deadline is not None and self.next_i == self.total:
                self.res.ended_by = "requests"  # the ceiling came before the clock
        else:
            while (self.next_i < self.total and t0 + self.offsets[self.next_i] <= now
                   and not holds(self.next_i)):
                self.arrive(self.next_i, t0 + float(self.offsets[self.next_i]))
                self.next_i += 1
        self.flush_arrivals()

    def can_form(self) -> bool:
        """A step may form: requests ready, source rows free, the sends not behind,
        and the engine's queue not past transport.max_inflight_blocks with this step (one
        step always may when nothing is in flight)."""
        if not (self.ready and self.rows.src.available and self.sender.backlog < 2):
            return False
        out = self.blocks_out - self.sender.blocks_done
        rows = 1 if self.phase.coalesce else min(self.phase.batch_size, len(self.ready))
        step = rows * self.blocks_per_request  # a coalesced step is about one run per rank
        return out == 0 or out + step <= self.settings.max_inflight_blocks

    def waits_for_sender(self) -> bool:
        """Whether only a finished step lets this loop go on: a judged request waits for its
        send to finish, or a ready step waits for rows, the sends' backlog or the engine's
        queue (what a finished send frees)."""
        return self.judged_unsent > 0 or bool(self.ready) or self.stopping

    def wait_ms(self, now: float, t0: float) -> int:
        if self.can_form() or self.more_now:
            return 0
        if self.offsets is not None and self.next_i < self.total and not self.stopping:
            return max(0, min(HEAR_MS, int((t0 + self.offsets[self.next_i] - now) * 1000)))
        return HEAR_MS

    def drain(self, inst: Instance) -> None:
        """Every control message that has already arrived from this instance."""
        control = inst.control
        while cast(int, control.get(zmq.EVENTS)) & zmq.POLLIN:  # (no zmq.Again raised per drain)
            msg = self.links.open(control.recv_multipart(zmq.NOBLOCK), inst.auth)
            if msg is None:
                continue
            inst.last_heard = _clock()
            match msg:
                case wire.UpdateMsg(grants=grants, v=verdicts):
                    self.granted(inst, grants)
                    self.judged(inst, verdicts)
                case wire.ErrorMsg(detail=detail):
                    self.settings.log.error("decode_error", decode=inst.index, detail=detail)
                case _:
                    self.res.rejected += 1

    def granted(self, inst: Instance, grants: wire.Rows) -> None:
        """Slots granted: each request granted once, by its own instance, while it waits."""
        for rid, slot in grants:
            req = self.outstanding.get(rid)
            if req is None or req.inst != inst.index or req.verdict is not None:
                self.res.rejected += 1  # not ours, or already done
                continue
            if req.dst_slot >= 0:
                self.res.replayed += 1  # a second grant for one request
                continue
            req.dst_slot = slot
            inst.ungranted -= 1
            self.ready.append(req)

    def stop(self, detail: Detail) -> None:
        """Interrupted: announce nothing more, give what is in flight a moment, then fail
        the rest with a reason."""
        self.stopping = True
        self.res.interrupted = True
        deadline = _clock() + 0.3
        while self.outstanding and _clock() < deadline:
            events = self.links.poll(min(self.pump(), 20))
            self.take_sent()
            for inst in self.links.instances:
                if inst.control in events:
                    self.drain(inst)
        now = _clock()
        for req in list(self.outstanding.values()):
            if req.verdict is None:
                req.verdict = (Outcome.failed, detail, None)
                self.finish(req, now)
        if self.deadline is not None:  # a duration's ceiling was never a count to start
            self.end_arrivals()
        self.skip_unarrived()

    def skip_unarrived(self) -> None:
        """Requests that never arrived are not_started: counted, never failed, and given no
        line in requests.jsonl (an interrupted run may leave most of its requests here)."""
        n = self.total - self.next_i
        self.res.not_started += n
        self.finished += n
        self.next_i = self.total


_STEP = attrgetter("rid", "room", "pad", "dst_slot", "inst")
_OWN = attrgetter("rid", "room", "dst_slot", "set_buf_us", "content")  # a request's own record values
# what a forward step's requests share (its runs in a batch of finished requests)
_RUN = attrgetter("inst", "route", "send_us", "verdict", "t_done", "t_arrive", "t_step", "t_taken", "t_ready",
                  "t_landed", "t_status_out", "t_status_in")


def finished_columns(reqs: Sequence[Req], labels: Callable[[Sequence[int]], list[Optional[str]]]) -> Finished:
    """Finished requests as the columns of their records (what finish() once built a Record
    of, per request): latencies rounded to 0.01 us, a handoff's times only for a verified
    one (from its step's start where it had a step), stage times for a verified one whose
    status the decode timed on this clock. `labels`: a fault's name for each request it hit.
    Consecutive requests that share everything but their own values (a step's) are one run:
    its latencies and stage times are computed once."""
    rid, room, dst, set_buf, content = zip(*map(_OWN, reqs))
    keys = list(map(_RUN, reqs))
    starts = [0, *itertools.compress(range(1, len(keys)), map(operator.ne, keys[1:], keys))]
    counts = list(map(operator.sub, starts[1:] + [len(keys)], starts))
    verified = Outcome.verified
    cols: tuple[list, ...] = ([], [], [], [], [], [], [], [], [], [])
    decode, route, send, handoff, e2e, outcome, detail, taken, t_done, stages = cols
    for i in starts:
        inst, r, send_us, (o, d, t), done, t_arrive, t_step, t_taken, t_ready, t_landed, t_out, t_in = keys[i]
        tv = t if o is verified else None
        decode.append(inst)
        route.append(r)
        send.append(None if send_us is None else round(send_us, 2))
        handoff.append(None if tv is None or not t_step else round((tv - t_step) * 1e6, 2))
        e2e.append(None if tv is None else round((tv - t_arrive) * 1e6, 2))
        outcome.append(o)
        detail.append(d)
        taken.append(round((t_taken - t_step) * 1e6, 2) if tv is not None and t_taken and t_step else None)
        t_done.append(done)
        stages.append((t_step, t_ready, t_landed, t_out, t_in, tv) if tv is not None and t_in and t_step else None)
    return Finished(rid, room, dst, list(map(_Rounded({None: None}).__getitem__, set_buf)), content, labels(rid),
                    counts, *cols)


class _Rounded(dict):
    """round(v, 2) of each distinct value, once (None stays None)."""

    def __missing__(self, v: float) -> float:
        r = self[v] = round(v, 2)
        return r
