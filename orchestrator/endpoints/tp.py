"""The decode instance's tensor-parallel group: what its ranks agree on each step.

SGLang's decode ranks of one TP group each receive a request's aux into their own
MetadataBuffers, poll their own transfer status, all-reduce (MIN) the statuses of the
requests in flight, and act on the agreed value (PR 26394 and follow-ups). This module does
that, over torch.distributed (gloo on CPU, NCCL on CUDA), every decode step, in lockstep:

  1. the leader (rank 0, which runs the control channel) broadcasts the grants made and the
     prefills released since the last step, so every rank holds the same queue, in order;
  2. each rank polls its queue: Failed, Transferring (no status yet, or, with
     gate.readiness, "done" while its own row's room is still 0), or Success;
  3. one all-reduce gives, per request, the MIN (the agreed status) and the MAX (to see where
     ranks disagreed before agreeing);
  4. each rank judges the requests agreed done on its own row (readiness on: room 0 or
     another room is corruption; off: the row is taken as it is, which is where a decode
     without the gate silently corrupts: this tool still checks the digest and counts it);
  5. one more all-reduce (MIN of outcome and reason) gives the verdict the leader sends.

What each rank saw and did is logged per step (tp-<process>.jsonl) and counted.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Optional

import torch

from ..outcomes import Detail, KVPoll, Outcome
from ..stats import LatencyHistogram

NOT_TAKEN = 1 << 20  # outcome slot of a request a rank did not take this step (never the MIN)


class Group:
    """One rank, nobody to agree with."""

    size = 1
    rank = 0

    def share_grants(self, endpoint: Any) -> None:
        endpoint.new_grants.clear()

    def any(self, flag: bool) -> bool:
        return flag

    def close(self) -> None:
        pass


_SINGLE = Group()


def single() -> Group:
    return _SINGLE


class TorchGroup(Group):
    """A decode instance of `size` ranks (processes)."""

    def __init__(self, rank: int, size: int, device: torch.device, log_path):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size, self.device = rank, size, device
        self.step_no = 0
        self.reduce_us = LatencyHistogram()
        self.stats = {"steps": 0, "steps_disagreed": 0, "requests_disagreed": 0,
                      "taken_unready": 0, "taken_wrong_room": 0, "gate_waits": 0,
                      "verdicts_split": 0}
        self.log = open(log_path, "w", buffering=1 << 16)
        self.queue: list = []  # the grants, in the order every rank shares

    # ---- collectives --------------------------------------------------------------------
    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device)

    def _reduce(self, values: list[int], op) -> list[int]:
        t = self._tensor(values)
        t0 = time.perf_counter()
        self.dist.all_reduce(t, op=op)
        out = t.tolist()
        self.reduce_us.add((time.perf_counter() - t0) * 1e6)
        return out

    def any(self, flag: bool) -> bool:
        return bool(self._reduce([int(flag)], self.dist.ReduceOp.MAX)[0])

    def share_grants(self, ep: Any) -> None:
        """The leader's grants and releases since the last step, on every rank."""
        dist = self.dist
        if self.rank == 0:
            grants = [x for g in ep.new_grants for x in (g.prank, g.rid, g.slot, g.room)]
            releases = list(ep.pending_releases)
            head = self._tensor([len(ep.new_grants), len(releases)])
        else:
            head = self._tensor([0, 0])
        dist.broadcast(head, src=0)
        n, r = head.tolist()
        if n or r:
            body = self._tensor(grants + releases) if self.rank == 0 else self._tensor([0] * (4 * n + r))
            dist.broadcast(body, src=0)
            flat = body.tolist()
            if self.rank == 0:
                self.queue.extend(ep.new_grants)
                for g in ep.new_grants:
                    g.shared = True  # every rank knows it now: the prefill may be told
            else:
                for i in range(n):
                    prank, rid, slot, room = flat[4 * i: 4 * i + 4]
                    self.queue.append(ep.adopt_grant(prank, rid, slot, room))
            for prank in flat[4 * n:]:
                for g in [g for g in self.queue if g.prank == prank]:
                    ep._remove(g)
                self.queue = [g for g in self.queue if g.prank != prank]
        ep.new_grants.clear()
        ep.pending_releases.clear()

    # ---- one step -----------------------------------------------------------------------
    def step(self, ep: Any) -> None:
        dist = self.dist
        queue = self.queue
        cands = [g for g in queue if g.status is not None]
        rows = ep.digest.read([g.slot for g in cands], [(g.prank, g.rid) for g in cands]) if cands else []
        read = {id(g): r for g, r in zip(cands, rows)}
        polls = []
        t_poll = time.monotonic()
        for g in queue:
            r = read.get(id(g))
            if r is None:
                polls.append(int(KVPoll.Transferring))
            elif g.status == KVPoll.Failed:
                polls.append(int(KVPoll.Failed))
            elif ep.unready(g, r, t_poll):  # the gate: "done", but this row has not landed
                polls.append(int(KVPoll.Transferring))
            else:
                polls.append(int(KVPoll.Success))
        n = len(queue)
        both = self._reduce([n, -n] + polls + [-p for p in polls], dist.ReduceOp.MIN)
        if both[0] != -both[1]:
            raise RuntimeError(f"decode TP ranks hold queues of {both[0]}..{-both[1]} requests")
        agreed, highest = both[2:2 + n], [-x for x in both[2 + n:]]
        disagreed = sum(a != h for a, h in zip(agreed, highest))
        now, now_ns = time.monotonic(), time.monotonic_ns()
        codes = []
        taken: list[tuple[Any, Outcome, Detail]] = []
        waits = 0
        for g, a in zip(queue, agreed):
            r = read.get(id(g))
            if a == KVPoll.Failed:
                own = Detail.sender_error if g.status == KVPoll.Failed else Detail.tp_disagreement
                taken.append((g, Outcome.failed, own))
            elif a == KVPoll.Success:
                outcome, detail = ep._judge(g, r)
                if detail is Detail.taken_unready:
                    self.stats["taken_unready"] += 1
                elif detail is Detail.room_mismatch and not ep.readiness:
                    self.stats["taken_wrong_room"] += 1
                taken.append((g, outcome, detail))
            elif r is not None and r.room == 0 and now - g.t_status > ep.timeout_s:
                taken.append((g, Outcome.failed, Detail.room_never_landed))
            elif r is not None:
                waits += 1
        took = {id(g): (o, d) for g, o, d in taken}
        # Every rank took the same positions (it acted on the same agreed vector).
        for g in queue:
            o_d = took.get(id(g))
            codes.append(NOT_TAKEN if o_d is None else o_d[0].code * 256 + o_d[1].code)
        if taken:
            worst = self._reduce(codes, dist.ReduceOp.MIN)
            verdicts = []
            for g, code, own in zip(queue, worst, codes):
                if code == NOT_TAKEN:
                    continue
                o, d = Outcome.of(code // 256), Detail.of(code % 256)
                if code != own:
                    self.stats["verdicts_split"] += 1
                verdicts.append((g, o, d))
            for g, o, d in verdicts:
                ep._finish(g, o, d, now_ns, own=took[id(g)], t_taken_ns=now_ns)
            gone = {id(g) for g, _, _ in verdicts}
            self.queue = [g for g in queue if id(g) not in gone]
        self.step_no += 1
        self.stats["steps"] += 1
        self.stats["gate_waits"] += waits
        if disagreed:
            self.stats["steps_disagreed"] += 1
            self.stats["requests_disagreed"] += disagreed
        if cands or taken:
            self.log.write(json.dumps({
                "step": self.step_no, "queue": n,
                "seen": {"success": polls.count(int(KVPoll.Success)),
                         "transferring": polls.count(int(KVPoll.Transferring)),
                         "failed": polls.count(int(KVPoll.Failed))},
                "agreed": {"success": agreed.count(int(KVPoll.Success)),
                           "failed": agreed.count(int(KVPoll.Failed))},
                "disagreed": disagreed, "took": len(taken),
                "taken_unready": sum(1 for _, _, d in taken if d is Detail.taken_unready)}) + "\n")
        ep.res.steps += 1
        ep._flush()

    def summary(self) -> dict[str, Any]:
        return {**self.stats, "rank": self.rank, "size": self.size,
                "allreduce_us": self.reduce_us.summary(), "allreduce_mean_us": self.reduce_us.mean}

    def close(self) -> None:
        self.log.close()
        try:
            self.dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer that is already gone
            pass


def join(plan, rendezvous: dict, tp_rank: int, tp: int, timeout_s: float, gpu: Optional[int],
         log_path) -> TorchGroup:
    """Join the instance's group (every rank calls this with the same rendezvous)."""
    import torch.distributed as dist

    backend = rendezvous["backend"]
    if backend == "nccl":
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=rendezvous["init_method"], world_size=tp,
                            rank=tp_rank, timeout=timedelta(seconds=max(30.0, 3 * timeout_s)))
    return TorchGroup(tp_rank, tp, device, log_path)
