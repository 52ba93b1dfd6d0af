"""The prefill's transfer thread wakes the main loop only when the loop said it waits for a
finished step (Sender.want_wake), and once. The hand-off is forced by hooks (log_decisions
runs after the wake-up), never by timing; the router is a stand-in recording its calls (no
bytes move: the real engine path is tests/test_transports.py)."""

import threading

import zmq

from orchestrator.handoff.backends.base import Send, Transfer
from orchestrator.handoff.endpoints.links import Link
from orchestrator.handoff.endpoints.sender import ForwardStep, Sender


class _Router:
    item_lens = [64, 64]
    starts_in_caller = True

    def __init__(self):
        self.calls = []

    def start(self, send):
        self.calls.append("start")

    def ready(self, send):
        return True

    def finish(self, send):
        self.calls.append("finish")
        send.latency_us = 100.0

    def after_send(self, send):
        self.calls.append("status")

    def after_step(self, transfers, per_step):
        self.calls.append("step")


def _step(router, rid):
    t = Transfer(rid, rid, 0, 0)
    link = Link(0, 0, None, router, "d0")  # type: ignore[arg-type]
    return ForwardStep([], [(link, [t], [Send([t])])], started=True)


def test_the_main_loop_is_woken_only_when_it_waits():
    ctx = zmq.Context()
    wake = ctx.socket(zmq.PAIR)
    wake.bind("inproc://wake-test")
    logged = threading.Semaphore(0)
    sender = Sender(ctx, "inproc://wake-test", lambda step: logged.release())
    sender.start()
    router = _Router()
    try:
        sender.submit(_step(router, 1))  # the loop does not wait: no wake-up
        assert logged.acquire(timeout=30)
        assert not wake.poll(0) and len(sender.done) == 1
        sender.want_wake = True  # the loop waits: one wake-up, then the flag is down
        sender.submit(_step(router, 2))
        assert logged.acquire(timeout=30)
        assert wake.poll(0) and wake.recv() == b"" and not sender.want_wake
        sender.submit(_step(router, 3))
        assert logged.acquire(timeout=30)
        assert not wake.poll(0) and len(sender.done) == 3
        assert router.calls == ["finish", "status", "step"] * 3  # started by the caller
    finally:
        sender.submit(None)
        sender.join(30)
        wake.close(0)
        ctx.term()

