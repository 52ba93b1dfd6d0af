"""Stuck in Transferring, as SGLang 0.5.23 would be (orchestrator.results.transferring): the
rule held against SGLang's own readiness gate (disaggregation/utils.py:_apply_metadata_gate)
and receiver poll (common/conn.py CommonKVReceiver._poll and _check_waiting_timeout), compiled
from the installed release; and faults=aux_lost, whose requests this tool fails after
transport.timeout_s while results.json and the summary count what SGLang would hold."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from orchestrator.results.outcomes import KVPoll
from orchestrator.results.reporting import summary
from orchestrator.results.schema import Results
from orchestrator.results.transferring import decode_poll, held

from .helpers import sglang_oracle

TIMEOUT = 300.0  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT's role


@pytest.fixture(scope="module")
def rules():
    try:
        return sglang_oracle.decode_rules()
    except sglang_oracle.OracleUnavailable as exc:
        pytest.skip(f"SGLang oracle unavailable: {exc}")


def _sglang(rules, status: KVPoll, room: int, waited: float, receiver=None) -> int:
    """One poll of SGLang's decode on one request `waited` seconds into `status`, then the gate."""
    t0 = 1000.0
    if receiver is None:
        receiver = sglang_oracle.ReceiverState(
            int(status), TIMEOUT,
            prefill_wait_start=t0 if status is KVPoll.Bootstrapping else None,
            init_time=t0 if status is KVPoll.WaitingForInput else None)
    rules.clock.now = t0 + waited
    polls = [int(rules.poll(receiver))]
    rows = np.zeros((4, 1), dtype=np.int64)
    rows[2, 0] = room
    rules.gate(polls, [SimpleNamespace(req=None, metadata_buffer_index=2)], SimpleNamespace(bootstrap_room=rows))
    return polls[0]


def held_for_ever(status: KVPoll, room: int) -> bool:
    """Whether SGLang 0.5.23 would keep the request in Transferring at every poll, whatever
    the time: Success delivered, room 0 (decode_poll's one state no clock leaves)."""
    return decode_poll(status, room, math.inf, 0.0) is KVPoll.Transferring and status is KVPoll.Success


def test_decode_poll_is_sglangs_gate_after_its_receiver(rules):
    assert [getattr(rules.KVPoll, v.name) for v in KVPoll] == [int(v) for v in KVPoll]
    for status, room, waited in itertools.product(KVPoll, (0, 1234), (0.0, TIMEOUT / 2, TIMEOUT, 3 * TIMEOUT)):
        assert int(decode_poll(status, room, waited, TIMEOUT)) == _sglang(rules, status, room, waited), \
            (status, room, waited)


def test_success_with_room_zero_is_transferring_at_every_poll_for_ever(rules):
    """The status arrived, the row never did: one receiver, polled over 100 timeouts."""
    receiver = sglang_oracle.ReceiverState(int(KVPoll.Success), TIMEOUT, None, 1000.0)
    seen = {_sglang(rules, KVPoll.Success, 0, k * TIMEOUT, receiver) for k in range(100)}
    assert seen == {int(KVPoll.Transferring)} and not receiver.kv_mgr.failures and not receiver.aborted
    assert held_for_ever(KVPoll.Success, 0)
    assert not held_for_ever(KVPoll.Success, 77) and not held_for_ever(KVPoll.WaitingForInput, 0)


def test_the_figure():
    assert held({}, 100, 64) is None
    exact = held({"room_never_landed": 20}, 200, 64, (0, 10))
    assert (exact.held_in_transferring, exact.slots_held, exact.no_slot_left_after) == (20, 20, 631)
    assert held({"room_never_landed": 20}, 200, 64).no_slot_left_after == 640  # measured rate
    full = held({"room_never_landed": 19}, 200, 16, (10, 10))
    assert (full.slots_held, full.no_slot_left_after) == (16, 161)
    assert "all 16 decode slots held: no slot left after 161 requests" in full.line()


@pytest.mark.integration
@pytest.mark.parametrize("route", ["engine", "tcp"])
def test_aux_lost_counts_what_sglang_would_hold(run_job, tmp_path, route):
    """faults=aux_lost every 10th from 5: this tool's verdict stays (failed after
    transport.timeout_s, room_never_landed); results.json and the summary add SGLang's view."""
    extra = ["mem_pool=NVLINK"] if route == "tcp" else []
    res = run_job(tmp_path, "faults=aux_lost", "faults.at_request=5", "faults.every=10",
                  "workload.requests=60", "buffers.size=16", "transport.timeout_s=1.0", *extra)
    assert res.plan.route == route
    assert (res.verified, res.corrupted, res.failed) == (54, 0, 6), res.failure_reasons
    assert res.failure_reasons == {"room_never_landed": 6}
    h = res.sglang_0_5_23
    assert (h.held_in_transferring, h.slots_held, h.decode_slots, h.no_slot_left_after) == (6, 6, 16, 156)
    data = json.loads(json.dumps(res.to_json()))
    assert data["sglang_0_5_23"]["held_in_transferring"] == 6
    assert Results.from_json(data).sglang_0_5_23 == h
    assert "SGLang 0.5.23 would keep 6 of these requests in Transferring for ever" in summary(res, tmp_path)
    assert "no slot is left after 156 requests" in summary(res, tmp_path)
