"""The decode instance's tensor-parallel group: what its ranks agree on each step.

SGLang's decode ranks of one TP group each receive a request's aux into their own
MetadataBuffers, poll their own transfer status, all-reduce (MIN) the statuses of the
requests in flight, and act on the agreed value (PR 26394 and follow-ups). The decode's step
(orchestrator.handoff.endpoints.decode) does that every step, in lockstep; this module runs its
collectives, over torch.distributed (gloo on CPU, NCCL on CUDA):

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

A single rank (`single()`) runs the same step: each agreement returns its input unchanged.
What each rank saw and did is logged per step (tp-<process>.jsonl) and counted.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch

from orchestrator.handoff.endpoints.control import Rendezvous
from orchestrator.results.outcomes import KVPoll, Outcome
from orchestrator.results.rundir import RunFile
from orchestrator.results.stats import LatencyHistogram

NOT_TAKEN = 1 << 20  # outcome slot of a request a rank did not take this step (never the MIN)
_VERIFIED = Outcome.verified.code  # a verdict code is outcome * 256 + detail


class Group:
    """One rank, nobody to agree with: every agreement is this rank's own input."""

    size = 1
    rank = 0

    def share(self, grants: list[tuple[int, int, int, int]], releases: list[int]
              ) -> tuple[list[tuple[int, int, int, int]], list[int]]:
        return grants, releases

    def agree_polls(self, polls: list[int]) -> list[int]:
        return polls

    def agree_verdicts(self, codes: list[int]) -> list[int]:
        return codes

    def tally(self, read: int, took: int, waits: int, unready: int, wrong_room: int) -> None:
        pass

    def any(self, flag: bool) -> bool:
        return flag

    def close(self) -> None:
        pass


_SINGLE = Group()


def single() -> Group:
    return _SINGLE


class TorchGroup(Group):
    """A decode instance of `size` ranks (processes): the collectives of each step, and what
    they showed (counted, and logged per step)."""

    def __init__(self, rank: int, size: int, device: torch.device, log_path: Path):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size, self.device = rank, size, device
        self.step_no = 0
        self.reduce_us = LatencyHistogram()
        self.stats = {"steps": 0, "steps_disagreed": 0, "requests_disagreed": 0,
                      "taken_unready": 0, "taken_wrong_room": 0, "gate_waits": 0,
                      "verdicts_split": 0}
        self.log = RunFile(log_path, "w", buffering=1 << 16)  # NoSpace names it
        self.seen: list[int] = []  # this step's polls, this rank's and agreed
        self.agreed: list[int] = []
        self.disagreed = 0  # requests of this step the ranks polled differently

    # ---- collectives --------------------------------------------------------------------
    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device)

    def _reduce(self, values: list[int], op: Any) -> list[int]:
        t = self._tensor(values)
        t0 = time.perf_counter()
        self.dist.all_reduce(t, op=op)
        out = t.tolist()
        self.reduce_us.add((time.perf_counter() - t0) * 1e6)
        return out

    def any(self, flag: bool) -> bool:
        return bool(self._reduce([int(flag)], self.dist.ReduceOp.MAX)[0])

    def share(self, grants: list[tuple[int, int, int, int]], releases: list[int]
              ) -> tuple[list[tuple[int, int, int, int]], list[int]]:
        """The leader's grants (prefill rank, rid, slot, room) and released prefill ranks
        since the last step, on every rank (two broadcasts; one when there are none)."""
        dist = self.dist
        head = self._tensor([len(grants), len(releases)] if self.rank == 0 else [0, 0])
        dist.broadcast(head, src=0)
        n, r = head.tolist()
        if not (n or r):
            return [], []
        body = self._tensor([x for g in grants for x in g] + list(releases) if self.rank == 0
                            else [0] * (4 * n + r))
        dist.broadcast(body, src=0)
        flat = body.tolist()
        return [tuple(flat[4 * i: 4 * i + 4]) for i in range(n)], flat[4 * n:]

    def agree_polls(self, polls: list[int]) -> list[int]:
        """One all-reduce: per request the MIN of every rank's poll (the agreed status) and
        the MAX (to see where ranks disagreed before agreeing)."""
        n = len(polls)
        both = self._reduce([n, -n] + polls + [-p for p in polls], self.dist.ReduceOp.MIN)
        if both[0] != -both[1]:
            raise RuntimeError(f"decode TP ranks hold queues of {both[0]}..{-both[1]} requests")
        agreed, highest = both[2:2 + n], [-x for x in both[2 + n:]]
        self.seen, self.agreed = polls, agreed
        self.disagreed = sum(a != h for a, h in zip(agreed, highest))
        return agreed

    def agree_verdicts(self, codes: list[int]) -> list[int]:
        """One all-reduce of the verdict codes (NOT_TAKEN: not taken this step) whenever the
        agreed queue holds any: the ranks' queues are the same length (agree_polls), so every
        rank makes the same collective calls, whatever it took. Ranks can differ in what they
        took (one's gate still holds a row another's took, or one's wait for a room ran out
        first): a request is decided only where the worst code is a failure or every rank
        took it; a verified request that some rank still holds stays NOT_TAKEN everywhere
        (never verified past a rank that did not see its row whole)."""
        if not codes:
            return codes
        n = len(codes)
        both = self._reduce(codes + [-c for c in codes], self.dist.ReduceOp.MIN)
        worst, held = both[:n], [-x == NOT_TAKEN for x in both[n:]]
        out = [NOT_TAKEN if h and w // 256 == _VERIFIED else w for w, h in zip(worst, held)]
        self.stats["verdicts_split"] += sum(w != NOT_TAKEN and w != c for w, c in zip(out, codes))
        return out

    def tally(self, read: int, took: int, waits: int, unready: int, wrong_room: int) -> None:
        """The step's counts: rows read, requests taken (`unready` of them before their row
        landed, `wrong_room` with another room, gate off), held by the gate; the step's line
        in the log when it read or took any."""
        self.step_no += 1
        s = self.stats
        s["steps"] += 1
        s["gate_waits"] += waits
        s["taken_unready"] += unready
        s["taken_wrong_room"] += wrong_room
        if self.disagreed:
            s["steps_disagreed"] += 1
            s["requests_disagreed"] += self.disagreed
        if read or took:
            seen, agreed = self.seen, self.agreed
            self.log.write(json.dumps({
                "step": self.step_no, "queue": len(seen),
                "seen": {"success": seen.count(int(KVPoll.Success)),
                         "transferring": seen.count(int(KVPoll.Transferring)),
                         "failed": seen.count(int(KVPoll.Failed))},
                "agreed": {"success": agreed.count(int(KVPoll.Success)),
                           "failed": agreed.count(int(KVPoll.Failed))},
                "disagreed": self.disagreed, "took": took, "taken_unready": unready}) + "\n")

    def summary(self) -> dict[str, Any]:
        return {**self.stats, "rank": self.rank, "size": self.size,
                "allreduce_us": self.reduce_us.summary(), "allreduce_mean_us": self.reduce_us.mean}

    def close(self) -> None:
        self.log.close()
        try:
            self.dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer that is already gone
            pass


def join(rendezvous: Rendezvous, tp_rank: int, tp: int, timeout_s: float, gpu: Optional[int],
         log_path: Path) -> TorchGroup:
    """Join the instance's group (every rank calls this with the same rendezvous)."""
    import torch.distributed as dist

    backend = rendezvous.backend
    if backend == "nccl":
        assert gpu is not None  # a CUDA plan places every process on a GPU (plan.gpu_placement)
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=rendezvous.init_method, world_size=tp,
                            rank=tp_rank, timeout=timedelta(seconds=max(30.0, 3 * timeout_s)))
    return TorchGroup(tp_rank, tp, device, log_path)
