"""The prefill's send path. SendQueue: a step's sends start as it is submitted (its tags known)
or at the next pump (still sealed on the device), finish in order with each status behind its
send, one step a pump, a send a fault holds back lets the ones behind it go first, at most
max_inflight are in flight. Sender: a step alone in flight runs to completion on the loop's
thread, others go to the transfer thread (with what the loop left in the queue) or, without
`overlap` (the loops block), stay on the loop's thread too; the thread wakes
the loop only when it waits (want_wake), and once; close gives up on a write that never
returns. Holds and hand-offs are forced by hooks, never by timing; the router is a stand-in
recording its calls (no bytes move: the real engine path is tests/test_transports.py)."""

import threading

import zmq

from orchestrator.handoff.backends.base import Send, Transfer
from orchestrator.handoff.endpoints.links import Link, Req
from orchestrator.handoff.endpoints.sender import ForwardStep, Sender, SendQueue


class _Router:
    item_lens = [64, 64]
    starts_in_caller = True

    def __init__(self):
        self.calls = []
        self.threads = set()  # the threads that finished sends
        self.held = set()  # rids whose send is not ready (a fault holds it)
        self.gate = None  # a threading.Event finish() waits on (a write that does not return)
        self.unlanded = set()  # rids whose write has not landed (landed() says so, finish() would wait)
        self.asked = 0  # landed() calls

    def start(self, send):
        self.calls.append(("start", send.transfers[0].rid))

    def ready(self, send):
        return send.transfers[0].rid not in self.held

    def landed(self, send):
        self.asked += 1
        return send.transfers[0].rid not in self.unlanded

    def finish(self, send):
        assert send.transfers[0].rid not in self.unlanded, "finish() would wait in the engine"
        if self.gate is not None:
            self.gate.wait()
        self.calls.append(("finish", send.transfers[0].rid))
        self.threads.add(threading.get_ident())
        send.latency_us = 100.0

    def after_send(self, send):
        self.calls.append(("status", send.transfers[0].rid))

    def after_step(self, transfers, per_step):
        self.calls.append(("step", transfers[0].rid))


class _Sealed:
    """A step still sealed on the device: its tags once result() is asked."""

    ready = False

    def __init__(self, tags):
        self.tags = tags
        self.asked = 0

    def result(self):
        self.asked += 1
        return self.tags, [f"{t:012x}" for t in self.tags]


def _step(router, rid, sealed=None):
    t = Transfer(rid, rid, 0, 0)
    link = Link(0, 0, None, router, "d0")  # type: ignore[arg-type]
    return ForwardStep([Req(rid, rid, 0, 0.0, (0, 0))], [(link, [t], [Send([t])])], sealed=sealed)


def test_sends_start_at_submit_and_finish_in_order_one_step_a_pump():
    router, logged = _Router(), []
    sends = SendQueue(logged.append)
    steps = [_step(router, rid) for rid in (1, 2, 3)]
    for step in steps:
        sends.submit(step)
    assert router.calls == [("start", 1), ("start", 2), ("start", 3)]  # before any pump
    assert sends.busy and not sends.done
    for n in (1, 2, 3):  # the loop hears its sockets between two steps
        assert sends.pump() and len(sends.done) == n
    assert not sends.pump()  # nothing left to finish
    assert router.calls[3:] == [(c, rid) for rid in (1, 2, 3) for c in ("finish", "status", "step")]
    assert list(sends.done) == steps == logged and not sends.busy
    assert sends.blocks_done == 3 * len(router.item_lens) and sends.inflight == 0
    assert all(s.sends and s.sends[0][1].t_status > 0 for s in steps)


def test_a_held_send_lets_the_ones_behind_it_go_first():
    router = _Router()
    router.held.add(1)
    sends = SendQueue(lambda step: None)
    first, second = _step(router, 1), _step(router, 2)
    sends.submit(first)
    sends.submit(second)
    assert sends.pump() and list(sends.done) == [second] and sends.busy
    assert not sends.pump()  # the held one waits: the loop looks again within a millisecond
    assert ("status", 1) not in router.calls
    router.held.clear()  # released (its verdicts came back, or its margin passed)
    assert sends.pump() and list(sends.done) == [second, first] and not sends.busy


def test_at_most_max_inflight_sends_and_one_step_always_may():
    router = _Router()
    router.held.add(1)
    sends = SendQueue(lambda step: None, max_inflight=1)
    sends.submit(_step(router, 1))
    sends.submit(_step(router, 2))
    assert sends.inflight == 1 and sends.backlog == 1  # the second waits for a send to finish
    assert not sends.pump() and sends.backlog == 1 and not sends.done
    router.held.clear()
    sends.pump()  # the first finishes and the second starts
    assert [s.reqs[0].rid for s in sends.done] == [1] and sends.backlog == 0 and sends.inflight == 1
    sends.pump()
    assert [s.reqs[0].rid for s in sends.done] == [1, 2] and not sends.busy


def test_a_step_sealed_on_the_device_starts_at_the_pump_with_its_tags():
    router = _Router()
    sends = SendQueue(lambda step: None)
    sealed = _Sealed([0xABC])
    step = _step(router, 7, sealed)  # type: ignore[arg-type]
    sends.submit(step)
    assert sends.backlog == 1 and not router.calls and not sealed.asked  # the loop forms more first
    sends.pump()
    assert sealed.asked == 1 and step.work[0][1][0].tag == 0xABC and step.reqs[0].content == f"{0xABC:012x}"
    assert router.calls[0] == ("start", 7) and list(sends.done) == [step]


class _Pair:
    """A Sender with its wake-up socket's bound end; the thread says when it logged a step."""

    def __init__(self, name, overlap=True, polls=False):
        self.ctx = zmq.Context()
        self.wake = self.ctx.socket(zmq.PAIR)
        self.wake.bind(f"inproc://{name}")
        self.logged = threading.Semaphore(0)
        self.sender = Sender(self.ctx, f"inproc://{name}", lambda step: self.logged.release(), overlap=overlap,
                             polls=polls)
        self.sender.start()

    def close(self):
        assert self.sender.close(30)
        self.wake.close(0)
        self.ctx.term()


def test_a_step_alone_in_flight_runs_to_completion_on_the_loops_thread():
    pair, router = _Pair("wake-alone"), _Router()
    try:
        step = _step(router, 1)
        pair.sender.submit(step, alone=True)
        assert pair.sender.loop_drives and pair.sender.busy  # started here, not handed over
        assert pair.sender.pump() and list(pair.sender.done) == [step] and not pair.sender.busy
        assert router.threads == {threading.get_ident()} and pair.logged.acquire(timeout=0)
        assert not pair.wake.poll(0)  # nothing to wake: the loop finished it itself
    finally:
        pair.close()


def test_overlapping_steps_go_to_the_thread_with_what_the_loop_left():
    pair, router = _Pair("wake-overlap"), _Router()
    sender = pair.sender
    try:
        router.held.add(1)
        sender.submit(_step(router, 1), alone=True)  # the loop's, held back by a fault
        assert not sender.pump() and sender.busy
        router.held.clear()
        sender.submit(_step(router, 2), alone=False)  # overlaps: the thread takes both
        assert pair.logged.acquire(timeout=30) and pair.logged.acquire(timeout=30)
        assert [s.reqs[0].rid for s in sender.done] == [1, 2]
        assert router.threads == {sender.thread.ident}
        assert not sender.pump()  # the queue was the thread's until it emptied
    finally:
        pair.close()


def test_without_overlap_the_loop_drives_every_step_and_finishes_all_it_started():
    """The loops block (a small host): overlapping steps stay on the loop's thread; one pump
    finishes every send it started, in order, each status behind its send."""
    pair, router = _Pair("wake-inline", overlap=False), _Router()
    sender = pair.sender
    try:
        steps = [_step(router, rid) for rid in (1, 2, 3)]
        for step in steps:
            sender.submit(step, alone=False)
        assert router.calls == [("start", 1), ("start", 2), ("start", 3)]  # started here, before any pump
        assert sender.loop_drives and sender.busy and not sender.thread.inbox
        assert sender.pump() and list(sender.done) == steps and not sender.busy
        assert router.calls[3:] == [(c, rid) for rid in (1, 2, 3) for c in ("finish", "status", "step")]
        assert router.threads == {threading.get_ident()} and not pair.wake.poll(0)
        router.held.add(4)  # held back by a fault: the one behind it goes, the loop looks again
        sender.submit(_step(router, 4), alone=False)
        sender.submit(_step(router, 5), alone=False)
        assert sender.pump() and [s.reqs[0].rid for s in sender.done][3:] == [5] and sender.busy
        router.held.clear()
        assert sender.pump() and [s.reqs[0].rid for s in sender.done][3:] == [5, 4] and not sender.busy
        assert router.threads == {threading.get_ident()}
    finally:
        pair.close()


def test_a_pump_before_a_time_leaves_the_sends_started_since_and_says_so():
    """The loop finishes the writes of earlier passes and leaves those it started in this one
    (deferred) until it has heard its sockets; a held send does not count as deferred."""
    router, pair = _Router(), _Pair("wake-before", overlap=False)
    sender = pair.sender
    try:
        steps = [_step(router, rid) for rid in (1, 2, 3)]
        for step, t0 in zip(steps, (1.0, 2.0, 3.0)):
            sender.submit(step, alone=False)
            step.work[0][2][0].t0 = t0  # when its write started (the stand-in sets none)
        assert sender.pump(before=2.5) and list(sender.done) == steps[:2]
        assert sender.deferred and sender.busy and ("finish", 3) not in router.calls
        router.held.add(3)  # held back by a fault: nothing to finish, nothing deferred
        assert not sender.pump(before=5.0) and not sender.deferred and sender.busy
        router.held.clear()
        assert sender.pump() and list(sender.done) == steps and not sender.deferred and not sender.busy
    finally:
        pair.close()


def test_where_the_path_can_be_asked_the_loop_never_waits_in_the_engine():
    """`polls` (Mooncake's batch status): a write not landed is asked for at most LAND_SPIN_S,
    then left, deferred, and finish() is not called on it (the engine's wait would spin until
    its timeout on a cut link); once it landed, the next pump finishes it and the ones behind."""
    router, pair = _Router(), _Pair("wake-polls", overlap=False, polls=True)
    sender = pair.sender
    try:
        steps = [_step(router, rid) for rid in (1, 2, 3)]
        router.unlanded.add(2)
        for step in steps:
            sender.submit(step, alone=False)
        assert sender.pump() and list(sender.done) == steps[:1]
        assert sender.deferred and sender.busy and router.asked > 2  # asked again while it spun
        assert ("finish", 2) not in router.calls and ("finish", 3) not in router.calls  # in order
        router.unlanded.clear()
        assert sender.pump() and list(sender.done) == steps and not sender.deferred and not sender.busy
        assert router.calls[3:] == [(c, rid) for rid in (1, 2, 3) for c in ("finish", "status", "step")]
    finally:
        pair.close()


def test_the_main_loop_is_woken_only_when_it_waits():
    pair, router = _Pair("wake-test"), _Router()
    sender, wake = pair.sender, pair.wake
    try:
        sender.submit(_step(router, 1), alone=False)  # the loop does not wait: no wake-up
        assert pair.logged.acquire(timeout=30)
        assert not wake.poll(0) and len(sender.done) == 1
        sender.want_wake(True)  # the loop waits: one wake-up, then the flag is down
        sender.submit(_step(router, 2), alone=False)
        assert pair.logged.acquire(timeout=30)
        assert wake.poll(0) and wake.recv() == b"" and not sender.thread.want_wake
        sender.submit(_step(router, 3), alone=False)
        assert pair.logged.acquire(timeout=30)
        assert not wake.poll(0) and len(sender.done) == 3
        assert [c for c in router.calls if c[0] == "start"] == [("start", 1), ("start", 2), ("start", 3)]
    finally:
        pair.close()


def test_close_gives_up_on_a_write_that_never_returns():
    pair, router = _Pair("wake-stuck"), _Router()
    router.gate = threading.Event()  # finish() blocks until it is set: the engine never returns
    try:
        pair.sender.submit(_step(router, 1), alone=True)
        assert not pair.sender.close(0.05)  # the endpoint exits hard
    finally:
        router.gate.set()
    assert pair.sender.close(30)
    pair.wake.close(0)
    pair.ctx.term()


class _Clock:
    """The sender module's `time` in a test: a clock that moves only when the thread naps."""

    def __init__(self):
        import time as real

        self.real, self.now, self.naps = real, 1.0, 0

    def monotonic(self):
        return self.now

    def perf_counter(self):
        return self.real.perf_counter()

    def sleep(self, s):
        self.naps += 1
        self.now += 0.001  # each poll of the spinning thread moves the clock 1 ms
        self.real.sleep(0)


def _blocked(thread, bound_s=30.0):
    """Whether the transfer thread waits on its condition (within `bound_s`: a state, not a time)."""
    import time as real

    end = real.monotonic() + bound_s
    while real.monotonic() < end:
        with thread.ready:
            if thread.ready._waiters:  # CPython's Condition: the threads in wait()
                return True
        real.sleep(0.001)
    return False


def test_a_spinning_transfer_thread_blocks_once_idle(monkeypatch):
    """endpoints.poll=spin: the transfer thread polls for a hand-over only IDLE_SPIN_S after
    its last one, then waits on its condition (an idle thread that polls takes the GIL from
    the loop, which runs a step alone in flight itself); a step handed over then still runs.
    The clock is the test's: it moves 1 ms a poll, so the bound is counted, not timed."""
    from orchestrator.handoff.endpoints import sender as sender_mod

    clock = _Clock()
    monkeypatch.setattr(sender_mod, "time", clock)
    ctx = zmq.Context()
    wake = ctx.socket(zmq.PAIR)
    wake.bind("inproc://wake-spin")
    logged = threading.Semaphore(0)
    sender = Sender(ctx, "inproc://wake-spin", lambda step: logged.release(), spin=True)
    router = _Router()
    sender.start()
    try:
        assert _blocked(sender.thread) and clock.naps == 0  # never handed anything: no poll at all
        sender.submit(_step(router, 1), alone=False)
        assert logged.acquire(timeout=30) and router.threads == {sender.thread.ident}
        assert _blocked(sender.thread)
        polls = clock.naps
        assert 1 <= polls <= sender_mod.IDLE_SPIN_S / 0.001 + 1  # polled IDLE_SPIN_S, then waited
        sender.submit(_step(router, 2), alone=False)  # woken from its wait
        assert logged.acquire(timeout=30) and len(sender.done) == 2
    finally:
        assert sender.close(30)
        wake.close(0)
        ctx.term()


def test_a_finished_step_tells_its_seal_it_landed_unless_a_send_failed():
    """The seal's ring slot is reused without a device call only after the step landed
    (digest._Slot.reuse): the queue says so once every send of the step finished without an
    error, after take_seal() has cleared `sealed`."""
    from orchestrator.handoff.digest import Sealed

    router = _Router()
    sends = SendQueue(lambda step: None)
    ok, failed = Sealed([1], ["a"]), Sealed([2], ["b"])
    a, b = _step(router, 1, ok), _step(router, 2, failed)
    b.work[0][2][0].error = "write failed"
    assert a.seal is ok and not ok.landed
    for step in (a, b):
        step.take_seal()
        sends.submit(step)
        sends.pump()
    assert a.sealed is None and list(sends.done) == [a, b]
    assert ok.landed and not failed.landed
