"""One decode step, on one rank or many: poll the requests with a status -> agree on the
polls -> judge what was agreed on this rank's rows -> agree on the verdicts -> finish them. A
single rank's agreement is its own input; a TP group's ranks step in lockstep
(orchestrator.handoff.endpoints.tp)."""

from __future__ import annotations

import time
from typing import IO, Optional, Sequence

import structlog

from orchestrator.handoff.digest import RowCheck
from orchestrator.handoff.endpoints.common import rss_kb
from orchestrator.handoff.endpoints.decode_state import Grant, Ledger, Verdict
from orchestrator.handoff.endpoints.grants import Grants
from orchestrator.handoff.endpoints.judge import Judge, Rows
from orchestrator.handoff.endpoints.tp import NOT_TAKEN, Group
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.outcomes import Detail, KVPoll, Outcome
from orchestrator.results.records import DecodeResult
from orchestrator.results.rundir import RunFile

HOLDS = (Detail.room_never_landed, Detail.written_by_someone_else)  # failures that held a slot long
_VERIFIED, _NONE = Outcome.verified.code, Detail.none.code  # a verified verdict's codes
_WARM = 1000  # judged requests after which the process's memory is taken as warm (rss_kb_warm)


class Stepper:
    """The step of one decode rank: its ledger, rows, judge and group; the grants it frees;
    its verdicts file (`records`, a line per verdict); `slots`: buffers.size."""

    def __init__(self, ledger: Ledger, rows: Rows, judge: Judge, group: Group, grants: Grants,
                 res: DecodeResult, records: IO[str] | RunFile, log: structlog.stdlib.BoundLogger, slots: int):
        self.ledger, self.rows, self.judge, self.group, self.grants = ledger, rows, judge, group, grants
        self.res, self.records, self.log, self.slots = res, records, log, slots
        self.tag = getattr(records, "tag", "")  # the run's id, on every verdict line
        # a verified request's line after its identity (the same for every one)
        self.verified_tail = f'"outcome": "{Outcome.verified.value}", "detail": "{Detail.none.value}"{self.tag}}}\n'
        self.leader = group.rank == 0

    def step(self) -> None:
        """One decode step: poll the requests with a status, agree on the polls, judge what
        was agreed on this rank's rows, agree on the verdicts, finish them. One rank agrees
        with itself (a step of its own: no agreement to build); a TP group (every step, in
        lockstep) polls every grant, in the shared order, and judges at the time it agreed."""
        if self.group.size > 1:
            self.step_group()
            return
        if not self.ledger.ready:
            if self.rows.quarantine and (self.ledger.waiting
                                         or 4 * len(self.rows.quarantine) >= self.slots):
                self.rows.clear_pass()  # slots are wanted: a pass of its own
                self.grants.flush()
            return
        self.step_one()

    def step_one(self) -> None:
        """One rank's step over the requests with a status: one read pass, then the rows it
        verifies outright finished in bulk (Judge.clean), the others judged one by one (its
        poll is its agreed poll, its verdict the one given). Times: when each was judged and
        taken (the sglang gate's read, else the step's), failures never taken."""
        t0 = time.perf_counter()
        cands = list(self.ledger.ready.values())
        step, taken_at, gate_s, stall_s = self.rows.read_step(cands, t0)
        res, judge = self.res, self.judge
        res.gate_read_us.add(gate_s * 1e6)
        res.stall_us.add(stall_s * 1e6)
        now, now_ns = _clock(), time.monotonic_ns()
        clean = judge.clean(cands, step)
        waits = 0
        verified = []
        for i, (g, ok) in enumerate(zip(cands, clean)):
            if ok:
                verified.append(g)
                continue
            r = step.check(i)
            polled = judge.poll(g, r, now)
            v = judge.verdict(g, r, polled, now)
            if v is None:
                waits += 1
            elif polled == KVPoll.Success:
                taken = taken_at.get(g.slot, now_ns) if taken_at is not None else now_ns
                self.finish(g, v[0], v[1], time.monotonic_ns(), t_taken_ns=taken)
            else:
                self.finish(g, v[0], v[1], now_ns)
        if verified:
            self.finish_verified(verified, time.monotonic_ns(), taken_at, now_ns)
        res.gate_waits += waits
        res.verify_us.add((time.perf_counter() - t0) * 1e6)
        res.batch.add(len(cands))
        res.steps += 1
        self.grants.flush()

    def step_group(self) -> None:
        """A TP rank's step, in lockstep with its group: the leader's grants shared, every
        grant polled (a read of those with a status), the polls and the verdicts agreed."""
        self.share()
        cands = list(self.ledger.grants.values())
        rows = self.rows.read_plain(cands)
        now = _clock()
        polls = [self.judge.poll(g, r, now) for g, r in zip(cands, rows)]
        agreed = self.group.agree_polls(polls)
        now, now_ns = _clock(), time.monotonic_ns()  # the group judges at the time it agreed
        own, waits = self.own_verdicts(cands, rows, agreed, now, now_ns)
        worst = self.group.agree_verdicts([NOT_TAKEN if v is None else v.code for v in own])
        for g, v, code in zip(cands, own, worst):
            if code == NOT_TAKEN:
                continue
            outcome, detail = Outcome.of(code // 256), Detail.of(code % 256)
            if v is None:  # another rank's failure decided it while this rank's gate held it
                self.finish(g, outcome, detail, now_ns)
            else:
                self.finish(g, outcome, detail, v.t_ns, own=(v.outcome, v.detail), t_taken_ns=v.t_taken_ns)
        taken = [v for v in own if v is not None]  # the TP log's counts
        self.group.tally(read=sum(r is not None for r in rows), took=len(taken), waits=waits,
                         unready=sum(v.detail is Detail.taken_unready for v in taken),
                         wrong_room=0 if self.judge.readiness else
                         sum(v.detail is Detail.room_mismatch for v in taken))
        self.res.steps += 1
        self.grants.flush()

    def own_verdicts(self, cands: list[Grant], rows: Sequence[Optional[RowCheck]], agreed: list[int], now: float,
                     now_ns: int) -> tuple[list[Optional[Verdict]], int]:
        """A TP rank's verdict on each candidate (None: not this step) and how many the gate
        holds; they carry the agreed step's time."""
        out: list[Optional[Verdict]] = []
        waits = 0
        for g, r, a in zip(cands, rows, agreed):
            v = self.judge.verdict(g, r, a, now)
            if v is None:
                out.append(None)
                if r is not None:
                    waits += 1
            else:
                out.append(Verdict(*v, now_ns, now_ns))
        return out, waits

    def share(self) -> None:
        """The leader's grants and releases since the last step, on every rank (a TP group's
        ranks then hold the same grants, in the same order)."""
        led = self.ledger
        grants, releases = self.group.share([(g.prank, g.rid, g.slot, g.room) for g in led.new_grants],
                                            list(led.pending_releases))
        if self.leader:
            for g in led.new_grants:
                g.shared = True  # every rank knows it now: the prefill may be told
        else:
            for prank, rid, slot, room in grants:
                self.grants.adopt(prank, rid, slot, room)
        for prank in releases:
            for g in led.of(prank):
                self.grants.remove(g)
        led.new_grants.clear()
        led.pending_releases.clear()

    def finish_verified(self, gs: list[Grant], t_ns: int, taken_at: Optional[dict[int, int]], now_ns: int) -> None:
        """finish() for the requests one rank's step verified outright, in bulk: their
        verdicts (made at `t_ns`, taken as the sglang gate read each, else at `now_ns`), one
        write of their records, their slots freed."""
        res, n = self.res, len(gs)
        before = res.judged
        res.outcomes[Outcome.verified] += n
        if self.leader:
            verdicts = self.ledger.verdicts
            if taken_at is None:
                for g in gs:
                    verdicts[g.prank].append([g.rid, _VERIFIED, _NONE, t_ns, int(g.t_status * 1e9), now_ns])
            else:
                for g in gs:
                    verdicts[g.prank].append([g.rid, _VERIFIED, _NONE, t_ns, int(g.t_status * 1e9),
                                              taken_at.get(g.slot, now_ns)])
        tail = self.verified_tail
        self.records.write("".join([f'{{"prefill": {g.prank}, "rid": {g.rid}, {tail}' for g in gs]))
        self.grants.remove_many(gs)
        if before < _WARM <= before + n:
            res.memory["rss_kb_warm"] = rss_kb()

    def finish(self, g: Grant, outcome: Outcome, detail: Detail, t_ns: int,
               own: Optional[tuple[Outcome, Detail]] = None, t_taken_ns: int = 0) -> None:
        """The request's verdict (in a TP group: every rank's combined; `own` is this rank's
        judgement, which its counts and records keep). `t_taken_ns`: when the readiness gate
        let it through (0: never taken)."""
        mine, why = own if own is not None else (outcome, detail)
        self.res.outcomes[mine] += 1
        if mine is not Outcome.verified:
            self.res.details[why] += 1
            if why in HOLDS:  # how long its slot was held for nothing (reported when many)
                self.res.held_s[why.value] = self.res.held_s.get(why.value, 0.0) + _clock() - g.t_granted
            self.log.warning("handoff_rejected", prefill=g.prank, rid=g.rid, slot=g.slot, room=g.room,
                             outcome=mine.value, detail=why.value)
        if self.leader:
            self.ledger.verdicts[g.prank].append([g.rid, outcome.code, detail.code, t_ns,
                                                  int(g.t_status * 1e9), t_taken_ns])
        self.records.write(f'{{"prefill": {g.prank}, "rid": {g.rid}, "outcome": "{mine.value}", '
                           f'"detail": "{why.value}"{self.tag}}}\n')
        self.grants.remove(g)
        if self.res.judged == _WARM:
            self.res.memory["rss_kb_warm"] = rss_kb()
