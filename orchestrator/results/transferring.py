"""Requests stuck in Transferring, as SGLang 0.5.23's decode would leave them.

SGLang 0.5.23's decode polls each request's receiver (``disaggregation/common/conn.py``,
``CommonKVReceiver._poll``), then applies the readiness gate
(``disaggregation/utils.py:_apply_metadata_gate``) before the TP all-reduce:

- the receiver times out Bootstrapping and WaitingForInput only (after
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``); once the sender's status says Success it
  concludes Success for good, and Transferring has no timeout at all;
- the gate turns Success into Transferring while the request's metadata row still holds room 0.

So a request whose status arrived (Success) but whose row never landed is Transferring at
every poll, for ever, and keeps its decode slot (its metadata buffer index) until the server
restarts: sgl-project/sglang #31800 (open), #23272, #11648, #10110, #15665, #30609.
:func:`decode_poll` is that rule (tests/test_transferring.py holds it against SGLang's own
extracted gate and receiver). This tool fails such a request after ``transport.timeout_s``
(``room_never_landed``: the status said Success, the room stayed 0) and moves on;
:func:`held` says what SGLang 0.5.23 would have done with the run's requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from orchestrator.results.outcomes import Detail, KVPoll


def decode_poll(status: KVPoll, room: int, waited_s: float, waiting_timeout_s: float) -> KVPoll:
    """What SGLang 0.5.23's decode makes of one request at one poll, after the gate: `status`
    is what the receiver holds (the sender's last status), `room` the request's metadata row's
    room, `waited_s` how long it has been in that status."""
    if status is KVPoll.Success:
        return KVPoll.Transferring if room == 0 else KVPoll.Success
    if status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput) and waited_s >= waiting_timeout_s:
        return KVPoll.Failed
    return status


# this tool's verdict on such a request: the status said Success and the room was still 0 when
# transport.timeout_s ran out (endpoints.decode's Judge)
HELD_DETAIL = Detail.room_never_landed


@dataclass
class Held:
    """results.json `sglang_0_5_23`: what SGLang 0.5.23's decode would hold of this run."""

    held_in_transferring: int  # this run's requests it would keep in Transferring for ever
    slots_held: int  # one metadata slot each, never freed (at most decode_slots)
    decode_slots: int  # buffers.size x decode instances
    no_slot_left_after: Optional[int]  # requests, at this run's rate of such requests
    how: str  # how no_slot_left_after was reached

    def line(self) -> str:
        text = (f"SGLang 0.5.23 would keep {self.held_in_transferring} of these requests in Transferring "
                f"for ever (its receiver times out Bootstrapping and WaitingForInput only; the gate "
                f"holds Success with room 0), ")
        if self.slots_held >= self.decode_slots:
            text += (f"all {self.decode_slots} decode slots held: no slot left after "
                     f"{self.no_slot_left_after} requests ({self.how}), the decode takes nothing after")
        else:
            text += f"holding {self.slots_held} of {self.decode_slots} decode slots"
            if self.no_slot_left_after is not None:
                text += f"; at this rate no slot is left after {self.no_slot_left_after} requests ({self.how})"
        return text + "; this run failed each after transport.timeout_s"


def held(details: dict[str, int], requests: int, decode_slots: int, fault: Optional[tuple[int, int]] = None
         ) -> Optional[Held]:
    """From a run's failure reasons. `fault`: (at_request, every) of a per-request fault that
    loses every such request on the run's one prefill rank (the exact figure); otherwise the
    run's measured rate."""
    stuck = details.get(HELD_DETAIL.value, 0)
    if not stuck:
        return None
    if fault is not None:
        at, every = fault
        after = at + (decode_slots - 1) * every + 1
        how = f"request {at} and every {every}th after it, {decode_slots} slots"
    else:
        after = math.ceil(decode_slots * requests / stuck)
        how = f"{stuck} of {requests} requests, {decode_slots} slots"
    return Held(stuck, min(stuck, decode_slots), decode_slots, after, how)
