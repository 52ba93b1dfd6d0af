"""The prefill's send path as its main loop drives it. A ForwardStep is one forward step's
requests and, per decode process, its sends. SendQueue starts a step's sends, finishes them in
order, sends each status behind its send and hands the finished step back, on whichever thread
drives it. Sender picks that thread per step: a step alone in flight runs to completion on the
loop's own thread (no thread hop between its write, its completion and its status). Steps that
overlap go to the transfer thread where the loops spin (endpoints.poll; hosts of 8 cores or
more), which finishes each write as it lands while the loop fills the next (Mooncake's wait
releases the GIL). Where the loops block (a small host), the loop drives every step itself:
it forms what it can, then finishes every write started (the earlier ones landed meanwhile);
the thread's wake-ups and the GIL passed back and forth cost more there than the overlap buys
(BENCHMARKS.md). Where the path can be asked (Mooncake's batch status,
backends/mooncake/completion.py), the loop never waits in the engine: it asks a write's
completion, spins on it at most LAND_SPIN_S, then hears its sockets and asks again, so a write
to a decode whose link was cut cannot hold it (the engine's own wait spins until its timeout,
~13 s there). Where a path cannot be asked (a wheel without the batch status), the loop waits
in the engine for a step alone in flight, and overlapping steps stay on the thread."""

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
IDLE_SPIN_S = 0.002  # a spinning transfer thread polls this long after a hand-over, then blocks
LAND_SPIN_S = 0.001  # the loop asks a write's completion this long, then hears its sockets first


@dataclass
class ForwardStep:
    """One forward step: its requests and, per decode process, its sends."""

    reqs: list[Req]
    work: list[tuple[Link, list[Transfer], list[Send]]]  # per decode process: its sends
    started: bool = False  # its sends were started already (by the loop, before a hand-over)
    sends: list[tuple[Link, Send]] = field(default_factory=list)  # as they finished
    open: int = 0  # sends started and not finished
    sealed: Optional[Sealed] = None  # until its tags and fingerprints are read
    # the same seal, kept after take_seal() clears `sealed`: told when every send of the step
    # landed (its device inputs are free)
    seal: Optional[Sealed] = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.seal = self.sealed

    def take_seal(self) -> None:
        """The tags (for statuses) and fingerprints (for records) of the step's rows. Device
        rows: taken when the step's sends start (the engine would wait for the same device
        work before reading the rows)."""
        if self.sealed is None:
            return
        tags, contents = self.sealed.result()
        self.sealed = None
        reqs = self.reqs
        for req, content in zip(reqs, contents):
            req.content = content
        by_rid: Optional[dict[int, int]] = None
        for _, transfers, _ in self.work:  # the tag travels in the status where rows have no kv_checksum
            if len(transfers) == len(reqs):  # every request of the step, in its order
                for t, tag in zip(transfers, tags):
                    t.tag = tag
                continue
            by_rid = by_rid or {req.rid: tag for req, tag in zip(reqs, tags)}
            for t in transfers:
                t.tag = by_rid[t.rid]


class SendQueue:
    """A prefill rank's sends, thread-free: driven by one thread at a time (Sender says which).
    submit() takes a sealed step: one whose tags are known starts its sends at once (the write
    is in the engine's hands before the caller goes on); one still sealed on the device starts
    at the next pump(). pump() starts what may start (up to `max_inflight` writes in flight,
    as SGLang's transfer workers keep several), then finishes sends in order (a send a fault
    holds back lets the ones behind it go first), each status behind its send, until a step is
    done (or, for the loop, until all are, or all started before a given time); a finished step
    lands in `done` (`landed` is called, then its decisions are logged).
    Finishing an engine write waits for it to land: in the engine's wait, or with `spin_s`
    (the loop, where the path can be asked) by asking its completion for at most that long;
    a send not landed by then is left, `deferred`."""

    def __init__(self, log_decisions: Callable[[ForwardStep], None], nap_s: float = 0.0,
                 max_inflight: int = 16):
        self.log_decisions = log_decisions
        self.landed: Callable[[], None] = lambda: None  # a step landed in `done` (before its log)
        self.nap_s = nap_s  # completion=nap: leave the core to Mooncake's transport threads first
        self.max_inflight = max_inflight
        self.queue: collections.deque[ForwardStep] = collections.deque()  # submitted, not started
        self.pending: Pending = collections.deque()  # started, not finished
        self.done: collections.deque[ForwardStep] = collections.deque()  # finished, not yet taken
        self.inflight = 0  # sends started, not finished
        self.blocks_done = 0  # blocks of finished sends
        self.deferred = False  # the last pump() left a send: started since `before`, or not landed in `spin_s`

    @property
    def backlog(self) -> int:
        """Steps submitted and not yet started."""
        return len(self.queue)

    @property
    def busy(self) -> bool:
        """Sends submitted and not finished (pump() finished what it could: a fault holds them)."""
        return bool(self.queue or self.pending)

    def submit(self, step: ForwardStep) -> None:
        self.queue.append(step)
        if step.sealed is None:  # the tags are known: the write goes now
            self.start_queued()

    def start_queued(self) -> None:
        """Start submitted steps in order, while fewer than max_inflight sends are in flight
        (one step always may when none is)."""
        queue = self.queue
        while queue and (self.inflight < self.max_inflight or not self.pending):
            self._start(queue.popleft())

    def pump(self, drain: bool = False, before: Optional[float] = None, spin_s: Optional[float] = None) -> bool:
        """Start what may start, then finish sends in order until a step is done (the transfer
        thread then takes what was handed over since, and starts it: the engine's queue stays
        fed), or with `drain` until none is left (the loop, which formed what it could before:
        it hears its sockets next), or until none can finish now. `before`: finish only sends
        started before this time (monotonic s); the next one left is `deferred`, as is one not
        landed within `spin_s` (where given). Whether any send finished."""
        self.start_queued()
        done, finished = len(self.done), False
        self.deferred = False
        while self.pending and (drain or len(self.done) == done):
            if not self._finish_oldest(before, spin_s):
                break
            finished = True
            if self.queue:
                self.start_queued()
        return finished

    def _start(self, step: ForwardStep) -> None:
        step.take_seal()  # tags before any status can go (a fault may send it at start)
        pending = self.pending
        for link, transfers, sends in step.work:
            for send in sends:
                if not step.started:
                    link.router.start(send)
                pending.append((step, link, transfers, send))
                step.open += 1
                self.inflight += 1
        step.started = True

    def _finish_oldest(self, before: Optional[float] = None, spin_s: Optional[float] = None) -> bool:
        """Finish the oldest send that can be finished (in order, unless a send is held
        back: then the ones behind it go first); False when none can, or when that send
        started at or after `before`, or has not landed within `spin_s` (then it is
        `deferred`)."""
        pending = self.pending
        i = next((k for k, p in enumerate(pending) if p[1].router.ready(p[3])), None)
        if i is None:
            return False
        step, link, transfers, send = pending[i]
        if before is not None and send.t0 >= before:
            self.deferred = True
            return False
        if self.nap_s:
            left = send.t0 + self.nap_s - time.monotonic()
            if left > 0:
                time.sleep(left)  # leave the core to Mooncake's transport threads meanwhile
        router = link.router
        if spin_s is not None and not router.landed(send):
            deadline = time.monotonic() + spin_s
            while not router.landed(send):
                if time.monotonic() > deadline:
                    self.deferred = True
                    return False
        router.finish(send)
        del pending[i]
        self.inflight -= 1
        self.blocks_done += len(router.item_lens)
        router.after_send(send)
        send.t_status = time.monotonic()
        step.sends.append((link, send))
        step.open -= 1
        if not any(p[0] is step and p[1] is link for p in pending):
            router.after_step(transfers, send.per_step)
        if step.open == 0:
            if step.seal is not None and all(s.error is None for _, s in step.sends):
                step.seal.landed = True
            self.done.append(step)
            self.landed()
            self.log_decisions(step)
        return True


class TransferThread(threading.Thread):
    """Drives a SendQueue for the steps handed to it (Sender.submit), and holds it from the
    first hand-over until it is empty again (`holds`: only then may the loop drive it itself).
    It wakes the main loop only when the loop waits for a finished step (want_wake), not per
    step: the loop takes finished steps on every pass, and a verdict, which follows the step's
    status, wakes it anyway."""

    def __init__(self, sends: SendQueue, ctx: zmq.Context, wake_addr: str,
                 device: Optional[torch.device] = None, spin: bool = False):
        super().__init__(name="sender", daemon=True)
        self.sends = sends
        self.spin = spin  # endpoints.poll: wait for work by polling (GIL released in between)
        self.device = device
        self.inbox: collections.deque[Optional[ForwardStep]] = collections.deque()
        self.ready = threading.Condition()
        self.wake = ctx.socket(zmq.PAIR)
        self.wake.connect(wake_addr)
        self.holds = False  # the queue is this thread's (set and cleared under `ready`)
        # the main loop waits for a step to finish (it set this before it polls): wake it
        # then, and only then (it drains finished steps on every pass anyway)
        self.want_wake = False
        self.error: Optional[str] = None
        self.took_at = 0.0  # when it last took a hand-over (monotonic s): it spins IDLE_SPIN_S after
        sends.landed = self._landed

    def submit(self, step: Optional[ForwardStep]) -> None:
        with self.ready:
            self.inbox.append(step)
            self.ready.notify()

    def _landed(self) -> None:
        # after the step's append: a loop that saw no step finished set the flag first
        if self.want_wake and self.holds:
            self.want_wake = False
            self.wake.send(b"", zmq.NOBLOCK)

    def _take(self, closing: bool) -> Optional[list[Optional[ForwardStep]]]:
        """The steps handed over since the last look (waiting for some while the queue is
        empty: it is the loop's meanwhile); None when closing and nothing is left. Spinning
        (endpoints.poll), it polls for a hand-over for IDLE_SPIN_S after its last one, then
        blocks: an idle thread that polls takes the GIL back every few microseconds, and the
        loop, which runs a step alone in flight itself, then runs its Python about 20% slower
        (forced switches every sys.getswitchinterval())."""
        sends = self.sends
        if self.spin:
            until = self.took_at + IDLE_SPIN_S
            while not self.inbox and not (self.holds and sends.busy) and not closing \
                    and time.monotonic() < until:
                time.sleep(0)
        with self.ready:
            while not self.inbox and not (self.holds and sends.busy):
                if closing:
                    return None
                self.holds = False
                self.ready.wait()
            self.holds = True
            new = list(self.inbox)
            self.inbox.clear()
        if new:
            self.took_at = time.monotonic()
        return new

    def run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        sends, closing = self.sends, False
        try:
            while (new := self._take(closing)) is not None:
                for step in new:
                    if step is None:
                        closing = True
                    else:
                        sends.submit(step)
                if sends.busy and not sends.pump():
                    time.sleep(0 if self.spin else 50e-6)
        except Exception as exc:  # noqa: BLE001 - reported by the main loop
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            try:
                self.wake.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        finally:
            self.wake.close(0)


class Sender:
    """The send path as the prefill's loop sees it: a SendQueue and the transfer thread.
    submit(step, alone): a step alone in flight (`alone`: no other request outstanding) while
    the thread holds nothing runs to completion on the loop's thread (its sends start now,
    pump() finishes them); with `overlap`, any other goes to the thread, with the queue and
    whatever the loop left in it. The thread pays for itself only where steps overlap (the
    loop fills the next one while it waits for a write: BENCHMARKS.md, "run to completion"),
    and only where its wake-ups are cheap: without `overlap` (the loops block: a small host)
    the loop drives every step, and the thread only finishes what is left at close()."""

    def __init__(self, ctx: zmq.Context, wake_addr: str, log_decisions: Callable[[ForwardStep], None],
                 nap_s: float = 0.0, max_inflight: int = 16, device: Optional[torch.device] = None,
                 spin: bool = False, overlap: bool = True, polls: bool = False):
        self.queue = SendQueue(log_decisions, nap_s, max_inflight)
        self.thread = TransferThread(self.queue, ctx, wake_addr, device, spin)
        self.overlap = overlap
        self.spin_s = LAND_SPIN_S if polls else None

    def start(self) -> None:
        self.thread.start()

    @property
    def done(self) -> collections.deque[ForwardStep]:
        """Finished steps, not yet taken by the loop."""
        return self.queue.done

    @property
    def blocks_done(self) -> int:
        return self.queue.blocks_done

    @property
    def backlog(self) -> int:
        """Steps handed over and not yet started."""
        return len(self.thread.inbox) + self.queue.backlog

    @property
    def loop_drives(self) -> bool:
        """Whether the queue is the loop's: nothing handed to the thread is left there (the
        thread takes it only from a hand-over, which only the loop makes)."""
        return not self.thread.holds and not self.thread.inbox

    @property
    def busy(self) -> bool:
        """Sends the loop itself has to finish (none while the thread holds the queue)."""
        return self.loop_drives and self.queue.busy

    @property
    def error(self) -> Optional[str]:
        return self.thread.error

    def want_wake(self, wants: bool) -> None:
        """The loop waits for a step the thread finishes (set before it looks at `done`)."""
        self.thread.want_wake = wants

    def submit(self, step: ForwardStep, alone: bool) -> None:
        if (alone or not self.overlap) and self.loop_drives:
            self.queue.submit(step)
            return
        # Rows sealed on the host side (host rows; fill=ahead, signed on the host): started
        # here, the write starts before the thread hop. Rows still being sealed on the device:
        # the thread starts them, so the engine's wait for that device work is not the loop's.
        if step.sealed is None and all(link.router.starts_in_caller for link, _, _ in step.work):
            for link, _, sends in step.work:
                for send in sends:
                    link.router.start(send)
            step.started = True
        self.thread.submit(step)

    def pump(self, before: Optional[float] = None) -> bool:
        """The loop drives the queue while the thread holds none of it: every send it started
        (before `before`, where given) finished in order where it can be (with `polls`, each
        landed within LAND_SPIN_S); whether a send finished."""
        return self.queue.pump(drain=True, before=before, spin_s=self.spin_s) if self.loop_drives else False

    @property
    def deferred(self) -> bool:
        """The loop's last pump() left a send started since its `before`, or one not landed
        yet (the loop hears its sockets first, then finishes it)."""
        return self.loop_drives and self.queue.deferred

    def close(self, timeout_s: float) -> bool:
        """The thread finishes what is left (the loop's too) and ends; False when a write
        never returned from the engine within `timeout_s` (the process must exit hard)."""
        if not self.thread.is_alive():
            return True
        self.thread.submit(None)
        self.thread.join(timeout_s)
        return not self.thread.is_alive()
