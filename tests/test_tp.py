"""Decode tensor-parallel groups and the readiness gate (gloo on CPU): a TP instance
verifies end to end; with the status overtaking the aux on one rank, the gate off shows the
divergence and the silent corruption it lets through (reproducibly), the gate on shows
none, and a stale room in a reused slot is caught only with zeroing on."""

from __future__ import annotations

import json

import pytest

from orchestrator.sweep.replay import deterministic

from .helpers.bounds import bound

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT = "transport.timeout_s=5"
RACE = ("endpoints.decode_tp=2", "faults=status_first", "faults.every=3")


@pytest.mark.parametrize("route", ["engine", "tcp"])
def test_decode_tp2_verifies_end_to_end(run_job, tmp_path, route):
    res = run_job(tmp_path, TIMEOUT, "endpoints.decode_tp=2", f"transport.route={route}",
                  "workload.requests=300", "workload.batch_size=4", "workload.concurrency=16")
    assert (res.verified, res.failed, res.corrupted) == (300, 0, 0), res
    tp = res.tp
    assert tp.ranks == 2 and tp.silent_corruptions == 0 and tp.hung == 0
    assert set(tp.per_rank) == {"decode0.0", "decode0.1"}
    assert all(r.outcomes == {"verified": 300} for r in tp.per_rank.values())  # on every rank
    assert tp.allreduce_us_mean > 0
    steps = [json.loads(x) for x in (tmp_path / "tp-decode0.1.jsonl").read_text().splitlines()]
    assert steps and {"seen", "agreed", "took", "disagreed"} <= set(steps[0])


def test_gate_off_lets_the_race_through_reproducibly(run_job, tmp_path):
    """The race is ordered, not timed: each hit request's aux to rank 1 is held until its
    verdict is back at the prefill (faults.margin_us, 60 s here, is only the
    longest wait), so rank 1 reads every such row before it lands, however loaded the box.
    On a stalled decode loop a time lead let the row land first (46 of 50 under load)."""
    runs = []
    for i in range(2):
        res = run_job(tmp_path / str(i), TIMEOUT, *RACE, "gate.readiness=false", "workload.requests=150",
                      "workload.concurrency=1", "workload.seed=0",  # one seed: same rooms
                      "faults.margin_us=60e6")  # released by the verdict; this is the cap
        runs.append(res)
        assert res.corrupted == 50 and res.verified == 100  # every third request
        tp = res.tp
        assert tp.steps_disagreed > 0 and tp.silent_corruptions == 50
        # taken_unready, or room_mismatch: the held row lands in its freed slot after the
        # verdict, before or after rank 1 zeroed it, and a later hit there reads that room
        assert set(res.failure_reasons) <= {"taken_unready", "room_mismatch"}
    assert deterministic(tmp_path / "0") == deterministic(tmp_path / "1")  # replays IDENTICAL


def test_status_first_holds_the_aux_until_its_verdict():
    """The hook that orders the race: a status_first send starts only once every request in
    it has its verdict (or the margin, here 60 s, passed); statuses go at once."""
    import threading
    from types import SimpleNamespace

    from orchestrator.handoff.backends.base import Send, Transfer
    from orchestrator.handoff.faults import FaultyRouter
    from orchestrator.profile.config import FaultKind, FaultsConfig, StatusMode

    class Inner:
        route = SimpleNamespace(value="engine")

        def __init__(self):
            self.statuses, self.started, self.judged_rids = [], [], []
            self.went = threading.Event()

        def connected_peer(self):
            return SimpleNamespace(tp_rank=1)

        def sends(self, transfers, coalesce=False, status=StatusMode.per_request):
            return [Send([t]) for t in transfers]

        def send_status(self, transfers, per_step):
            self.statuses += [t.rid for t in transfers]

        def start(self, send, push=None):
            self.started += [t.rid for t in send.transfers]
            if send.fault is not None:
                self.went.set()

        def finish(self, send):
            pass

        def judged(self, rid):
            self.judged_rids.append(rid)

    inner = Inner()
    router = FaultyRouter(inner, FaultsConfig(kind=FaultKind.status_first, at_request=0, every=2,
                                              margin_us=60e6, rank=1))
    sends = router.sends([Transfer(rid, 100 + rid, rid, rid) for rid in (0, 1)])
    for send in sends:
        router.start(send)
    held = next(s for s in sends if s.fault is not None)
    assert inner.statuses == [0] and inner.started == [1]  # rid 0's status went; its row did not
    router.judged(1)  # another request's verdict releases nothing
    assert not router.ready(held) and inner.started == [1]
    router.judged(0)
    assert inner.went.wait(bound())  # the delayer thread starts it (the margin would be 60 s)
    router.finish(held)
    assert inner.started == [1, 0] and inner.judged_rids == [1, 0]


def test_gate_on_same_race_verifies_everything(run_job, tmp_path):
    res = run_job(tmp_path, TIMEOUT, *RACE, "workload.requests=300",
                  "workload.batch_size=4", "workload.concurrency=16")
    assert (res.verified, res.corrupted, res.failed) == (300, 0, 0), res
    assert res.tp.silent_corruptions == 0 and res.tp.hung == 0
    assert res.tp.steps_disagreed > 0  # the ranks disagreed, and the gate held the request back


def test_stale_room_is_caught_only_with_zeroing_on(run_job, tmp_path):
    common = (*RACE, "faults.every=1", "workload.requests=200", "workload.batch_size=4",
              "workload.concurrency=16", "buffers.size=16")
    off = run_job(tmp_path / "off", TIMEOUT, *common, "gate.zero_room_on_free=false")
    assert off.failure_reasons.get("room_mismatch", 0) > 0  # the previous tenant's room passed the gate
    on = run_job(tmp_path / "on", TIMEOUT, *common)
    assert (on.verified, on.corrupted) == (200, 0), on.failure_reasons


def test_a_room_that_never_lands_fails_on_every_rank(run_job, tmp_path):
    """faults=aux_lost with decode_tp=2: each rank fails the requests whose rows never land
    (room_never_landed, after transport.timeout_s), whichever rank's wait runs out first;
    the group stays whole and verifies the rest."""
    res = run_job(tmp_path, "endpoints.decode_tp=2", "faults=aux_lost", "faults.at_request=5",
                  "faults.every=10", "workload.requests=60", "buffers.size=16", "transport.timeout_s=1.0")
    assert (res.verified, res.corrupted, res.failed) == (54, 0, 6), res.failure_reasons
    assert res.failure_reasons == {"room_never_landed": 6}
    assert all(r.outcomes == {"verified": 54, "failed": 6} for r in res.tp.per_rank.values()), res.tp.per_rank


def test_gate_holds_a_torn_row_until_it_settles():
    """gate.settle_ms: a row whose room is right but whose digest is not yet (the room block of
    a batch write landed first) counts as "transferring" within the window and is judged after
    it; settle_ms=0 is SGLang's room-only gate; readiness off holds nothing."""
    from types import SimpleNamespace

    from orchestrator.handoff.endpoints.decode_state import Grant
    from orchestrator.handoff.endpoints.judge import Judge
    from orchestrator.results.records import DecodeResult

    def endpoint(settle_s, readiness=True, digest_ok=False):
        return SimpleNamespace(readiness=readiness, settle_s=settle_s, res=DecodeResult("decode"),
                               _digest_ok=lambda g, r: digest_ok)

    g = Grant(0, 7, room=42, slot=3, pad=(0, 0), t_granted=0.0, t_status=100.0)
    torn, empty, whole = SimpleNamespace(room=42), SimpleNamespace(room=0), SimpleNamespace(room=42)
    ep = endpoint(0.05)
    assert Judge.unready(ep, g, torn, now=100.01) is True  # within the window
    assert Judge.unready(ep, g, torn, now=100.02) is True
    assert ep.res.settled == 1 and g.settling  # counted once
    assert Judge.unready(ep, g, torn, now=100.06) is False  # judged: corrupted
    assert Judge.unready(ep, g, empty, now=150.0) is True  # room 0: until timeout_s
    assert Judge.unready(endpoint(0.05, digest_ok=True), g, whole, now=100.01) is False
    assert Judge.unready(endpoint(0.0), g, torn, now=100.01) is False  # SGLang's gate
    assert Judge.unready(endpoint(0.05, readiness=False), g, empty, now=100.01) is False


def _agree_on_rank(rank, init, codes, out):
    """One rank of a two-rank gloo group: its TorchGroup's agree_verdicts on `codes`."""
    import tempfile
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from orchestrator.handoff.endpoints.tp import TorchGroup

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = TorchGroup(rank, 2, torch.device("cpu"), Path(tempfile.mkdtemp()) / "tp.jsonl")
    out.put((rank, group.agree_verdicts(codes)))
    group.close()  # destroys the process group


def test_ranks_that_took_different_requests_make_the_same_collectives(tmp_path):
    """The ranks' own verdicts differ where a room never landed: each rank's wait for it runs
    from its own status time, so one fails a request its peer still holds, and may take none
    this step while its peer takes one (faults=aux_lost with decode_tp=2 aborted the group in
    gloo: one rank all-reduced, the other did not). The divergence is given, not timed: both
    ranks all-reduce, the failure decides the request on both, and a verification one rank
    has not made yet decides nothing."""
    import multiprocessing as mp

    from orchestrator.handoff.endpoints.tp import NOT_TAKEN
    from orchestrator.results.outcomes import Detail, Outcome

    from .helpers.bounds import bound

    failed = Outcome.failed.code * 256 + Detail.room_never_landed.code
    verified = Outcome.verified.code * 256 + Detail.none.code
    own = {0: [failed, verified, NOT_TAKEN], 1: [NOT_TAKEN, NOT_TAKEN, NOT_TAKEN]}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_agree_on_rank, args=(r, init, own[r], out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=bound(60)) for _ in procs)
    for p in procs:
        p.join(bound(30))
        assert p.exitcode == 0
    assert got == {0: [failed, NOT_TAKEN, NOT_TAKEN], 1: [failed, NOT_TAKEN, NOT_TAKEN]}
