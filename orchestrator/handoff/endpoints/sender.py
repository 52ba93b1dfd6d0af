"""The prefill's transfer thread and the step it carries: a ForwardStep is one forward step's
requests and, per decode process, its sends; the Sender starts them as they come, finishes
them in order, sends each status behind its send, and wakes the main loop."""

from __future__ import annotations

import collections
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import zmq

from orchestrator.handoff.backends.base import Send, Transfer
from orchestrator.handoff.digest import Sealed
from orchestrator.handoff.endpoints.links import Link, Req

Pending = collections.deque[tuple["ForwardStep", Link, list[Transfer], Send]]


@dataclass
class ForwardStep:
    """One forward step: its requests and, per decode process, its sends."""

    reqs: list[Req]
    work: list[tuple[Link, list[Transfer], list[Send]]]  # per decode process: its sends
    started: bool = False  # the engine sends were submitted by the main thread already
    sends: list[tuple[Link, Send]] = field(default_factory=list)  # as they finished
    open: int = 0  # sends started and not finished
    sealed: Optional[Sealed] = None  # until its tags and fingerprints are read

    def take_seal(self) -> None:
        """The tags (for statuses) and fingerprints (for records) of the step's rows. Device
        rows: the transfer thread takes them before it starts the step's sends (the engine
        would wait for the same device work before reading the rows)."""
        if self.sealed is None:
            return
        tags, contents = self.sealed.result()
        self.sealed = None
        by_rid = {}
        for req, tag, content in zip(self.reqs, tags, contents):
            req.content = content
            by_rid[req.rid] = tag
        for _, transfers, _ in self.work:  # the tag travels in the status where rows have no kv_checksum
            for t in transfers:
                t.tag = by_rid[t.rid]


class Sender(threading.Thread):
    """The transfer thread: starts each step's sends as it comes (up to `max_inflight`
    writes in flight, as SGLang's transfer workers keep several), finishes them in order,
    sends each status behind its send, then wakes the main loop. Mooncake's calls release
    the GIL, so the scheduler thread fills the next step meanwhile. The main loop is woken only when it
    waits for a finished step (want_wake), not per step: it takes finished steps on every pass,
    and a verdict, which follows the step's status, wakes it anyway."""

    def __init__(self, ctx: zmq.Context, wake_addr: str, log_decisions: Callable[[ForwardStep], None],
                 nap_s: float = 0.0, max_inflight: int = 16, device: Optional[torch.device] = None,
                 spin: bool = False):
        super().__init__(name="sender", daemon=True)
        self.spin = spin  # endpoints.poll: wait for work by polling (GIL released in between)
        self.device = device
        self.queue: collections.deque[Optional[ForwardStep]] = collections.deque()
        self.done: collections.deque[ForwardStep] = collections.deque()
        self.ready = threading.Condition()
        self.wake = ctx.socket(zmq.PAIR)
        self.wake.connect(wake_addr)
        self.log_decisions = log_decisions
        self.nap_s = nap_s
        self.max_inflight = max_inflight
        self.inflight = 0  # sends started, not finished
        self.blocks_done = 0  # blocks of finished sends (written by this thread only)
        self.idle = False  # waiting for a step (a submit must notify)
        # the main loop waits for a step to finish (it set this before it polls): wake it
        # then, and only then (it drains finished steps on every pass anyway)
        self.want_wake = False
        self.error: Optional[str] = None

    @property
    def backlog(self) -> int:
        """Steps handed over and not yet started."""
        return len(self.queue)

    def submit(self, step: Optional[ForwardStep]) -> None:
        with self.ready:
            self.queue.append(step)
            if self.idle:
                self.ready.notify()

    def run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        pending: Pending = collections.deque()
        closing = False
        try:
            while not (closing and not pending):
                if self.spin:
                    while not self.queue and not pending and not closing:
                        time.sleep(0)
                with self.ready:
                    while not self.queue and not pending and not closing:
                        self.idle = True
                        self.ready.wait()
                        self.idle = False
                    new = []
                    while self.queue and (self.inflight < self.max_inflight or not pending):
                        step = self.queue.popleft()
                        if step is None:
                            closing = True
                            break
                        new.append(step)
                for step in new:
                    self._start(step, pending)
                if pending:
                    self._finish_oldest(pending)
        except Exception as exc:  # noqa: BLE001 - reported by the main loop
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            try:
                self.wake.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        finally:
            self.wake.close(0)

    def _start(self, step: ForwardStep, pending: Pending) -> None:
        step.take_seal()  # tags before any status can go (a fault may send it at start)
        for link, transfers, sends in step.work:
            for send in sends:
                if not step.started:
                    link.router.start(send)
                pending.append((step, link, transfers, send))
                step.open += 1
                self.inflight += 1

    def _finish_oldest(self, pending: Pending) -> None:
        """Finish the oldest send that can be finished (in order, unless a send is held
        back: then the ones behind it go first)."""
        i = next((k for k, p in enumerate(pending) if p[1].router.ready(p[3])), None)
        if i is None:
            time.sleep(0 if self.spin else 50e-6)
            return
        step, link, transfers, send = pending[i]
        if self.nap_s:
            left = send.t0 + self.nap_s - time.monotonic()
            if left > 0:
                time.sleep(left)  # leave the core to Mooncake's transport threads meanwhile
        link.router.finish(send)
        del pending[i]
        self.inflight -= 1
        self.blocks_done += len(link.router.item_lens)
        link.router.after_send(send)
        send.t_status = time.monotonic()
        step.sends.append((link, send))
        step.open -= 1
        if not any(p[0] is step and p[1] is link for p in pending):
            link.router.after_step(transfers, send.per_step)
        if step.open == 0:
            self.done.append(step)
            if self.want_wake:  # after the append: a loop that saw no step finished set it first
                self.want_wake = False
                self.wake.send(b"", zmq.NOBLOCK)
            self.log_decisions(step)

