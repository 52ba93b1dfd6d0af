"""Prefill endpoint (sender), shaped like SGLang's prefill scheduler.

A request is announced to its decode instance when it ARRIVES ("arrive", in bulk); decode
grants it a slot then, as SGLang's decode pre-allocates while the request bootstraps, so a
finished prefill never waits for a grant. Granted requests are taken `workload.batch_size`
at a time by a forward step, which

  1. fills each request's row (inline: SGLang's set_buf, timed per request as set_buf_us;
     ahead: every slot was filled before the timed phase, a request writes its room only),
  2. takes one digest pass over the whole step on the buffers' device (orchestrator.handoff.digest)
     and writes each tag into the row's kv_checksum field where the layout has one,
  3. sends it: a step alone in flight runs to completion on the loop's thread (its write
     submitted and waited for, its status sent, no thread hop); a step that overlaps others
     is handed to the transfer thread, and the loop goes on with the next step.

The sends (orchestrator.handoff.backends: one batch write per request, or per run of
consecutive slots) and the status messages, each behind its send, go through one queue
(endpoints.sender.SendQueue) that one thread drives at a time: the loop's own while a step is
alone in flight, else the transfer thread, overlapping with the next step's fill as SGLang's
transfer workers overlap its scheduler. Verdicts come back in batches. A decode
instance silent for `transport.timeout_s` while it owes us something is declared lost; its
requests fail with a reason, and the run goes on with the others. The other way round, the
loop tells every live instance something (an empty arrive when nothing else is due) at least
every min(1 s, timeout_s/4): a role=decode side, which cannot see this process, declares a
prefill rank silent for timeout_s lost even when it holds nothing of it.

Requests are identified by (prefill rank, request id) everywhere, never by room: duplicate
rooms (retries, n>1 sampling) each get their own slot and verdict.

Where the parts live: the hello/bootstrap exchange in endpoints.handshake, the decodes and
the control channel in endpoints.links, the send queue, the transfer thread and the
ForwardStep in endpoints.sender, a phase's main loop in endpoints.prefill_loop; this module
builds them from the rank's spec (orchestrator.handoff.specs.PrefillSpec). The process's
entry, which speaks the runner's pipe around it, is orchestrator.job.children.prefill_main.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import structlog
import torch
import zmq

from orchestrator.handoff.backends.base import Backend
from orchestrator.handoff.buffers import MetadataBuffers, SlotAllocator, StagedRows
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.endpoints import control
from orchestrator.handoff.endpoints.common import build_side, process_gpu, shapes
from orchestrator.handoff.endpoints.handshake import PrefillHandshake
from orchestrator.handoff.endpoints.links import Credentials, Instance, Links
from orchestrator.handoff.endpoints.prefill_loop import LoopSettings, PhaseSpec, PrefillLoop, SourceRows
from orchestrator.handoff.endpoints.sender import ForwardStep, Sender
from orchestrator.handoff.faults import LoopFaults
from orchestrator.handoff.specs import PrefillSpec
from orchestrator.handoff.transport.advert import Adverts
from orchestrator.handoff.transport.auth import Authenticator, new_nonce
from orchestrator.handoff.workload import RequestPool
from orchestrator.profile.kinds import CompletionSetting
from orchestrator.profile.platform import boot_id, usable_cores
from orchestrator.results.logs import DecisionLog
from orchestrator.results.paths import PrefillResult
from orchestrator.results.records import RankResult
from orchestrator.results.rundir import RunFile, RunFiles, proc_name


class PrefillEndpoint:
    # the tag travels in the (authenticated) status even when the row carries it too: the
    # decode then tells a row written by someone else from one corrupted on the way
    TAG_IN_STATUS = True

    def __init__(self, spec: PrefillSpec, run_dir: Path, log: structlog.stdlib.BoundLogger, rank: int,
                 secret: bytes):
        plan = self.plan = spec.plan
        self.spec, self.log, self.rank = spec, log, rank
        self.workload = spec.workload
        self.name = proc_name("prefill", rank, spec.ranks)
        self.side = build_side(spec.side, plan, self.name, run_dir, log, process_gpu(plan, "prefill", rank))
        buffers = self.side.buffers
        src = SlotAllocator(spec.side.buffers.size)
        nonce = new_nonce()
        self.me = Credentials(Authenticator(secret), nonce, Keys(secret, nonce), boot_id())
        digest = RowDigest(buffers, self.me.keys, spec.digest)
        device_rows = buffers.device.type == "cuda"
        # buffers.set_buf=staged (a phase's choice): SGLang's set_buf into pinned host rows,
        # one upload a step (device rows; on host rows both modes are SGLang's set_buf)
        staged = StagedRows(buffers) if device_rows else None
        buffers.warm()  # start-up pays the device's first-use costs, not request 1
        digest.warm_seal(spec.max_batch, staged)
        control.mark("warm-up")
        # Mooncake's intra-node NVLink transport records an event on the submitting thread's
        # per-thread stream and waits for it before it copies; work on the legacy default
        # stream (torch's default) is ordered before that event, so a step's row writes land
        # before the engine reads them without a wait of ours (tests/test_gpu.py shows it).
        # Elsewhere the step syncs its stream once.
        engine_orders_writes = bool(
            device_rows and self.side.transport == "mooncake-nvlink_intra"
            and torch.cuda.current_stream(buffers.device).cuda_stream == 0)
        log.info("step_ordering", engine_orders_writes=engine_orders_writes,
                 set_buf=spec.set_buf.value)
        pool = RequestPool(spec.workload, shapes(spec.side.buffers, buffers))
        self.rows = SourceRows(buffers, src, pool, digest, self.me.keys, staged, engine_orders_writes)
        self.ctx = zmq.Context()
        self.links = Links(self.ctx, self.me, log, spec.timeout_s)
        self.memory: dict[str, int] = {}
        self.stuck = False  # a Mooncake call that never returned: exit hard
        self.bulk_ptr: Optional[int] = None  # the benchmark's bandwidth target (connect())
        files, ranks = RunFiles(run_dir), spec.ranks
        static = {
            "mem_pool": plan.mem_pool.value, "buffer_device": plan.buffer_device.value,
            "route": plan.route.value, "reason": plan.route_reason.value,
            "transport": self.side.transport, "row_bytes": buffers.row_bytes,
            "fallback": plan.events[0].reason.value if plan.events else None,
        }
        self.decisions = DecisionLog(files.decisions(self.name, ranks), self.name, static)
        self.records_path = files.requests(self.name, ranks)
        RunFile(self.records_path, "w").close()  # this process's records start here (phases append)
        self._sender: Optional[Sender] = None

    @property
    def buffers(self) -> MetadataBuffers:
        return self.side.buffers

    @property
    def backend(self) -> Backend:
        """What carries this rank's rows (orchestrator.handoff.backends): the bench asks it
        for its raw calls."""
        return self.side.backend

    @property
    def staged(self) -> Optional[StagedRows]:
        """Pinned host rows for buffers.set_buf=staged (device rows only)."""
        return self.rows.staged

    @property
    def instances(self) -> list[Instance]:
        return self.links.instances

    @property
    def sender(self) -> Sender:
        """The send path: its queue and the transfer thread (connect() starts it)."""
        assert self._sender is not None, "connect() first"
        return self._sender

    # ---- bootstrap ----------------------------------------------------------------------
    def connect(self, decodes: Adverts) -> None:
        """Bootstrap with every decode rank (orchestrator.handoff.endpoints.handshake), then
        start the transfer thread."""
        spec = self.spec
        self.bulk_ptr = decodes[0][0].bulk_ptr
        handshake = PrefillHandshake(self.links, self.side, self.plan, self.rank, spec.faults, self.TAG_IN_STATUS,
                                     spec.address_check)
        try:
            handshake.connect(decodes)
        finally:
            self.stuck = self.stuck or handshake.stuck
        spin = spec.poll.spins(usable_cores())
        nap_s = spec.nap_us / 1e6 if self.plan.completion is CompletionSetting.nap else 0.0
        # The loop asks its writes' completion without waiting where every path can (Mooncake's
        # batch status: completion.py): it never blocks in the engine. Steps that overlap go
        # to the transfer thread where the loops spin (a host of 8 cores or more) or where a
        # path cannot be asked; else the loop drives every step (Sender).
        polls = all(link.router.polls for inst in self.links.instances for link in inst.links)
        overlap = spin or not polls
        self._sender = Sender(self.ctx, self.links.wake_addr, self.log_decisions, nap_s,
                              spec.max_inflight_sends, self.buffers.device, spin, overlap=overlap, polls=polls)
        self.log.info("prefill_loop", transfer_thread="spin" if spin else "block", alone_in_flight="inline",
                      overlapping="transfer_thread" if overlap else "inline",
                      completion="polled" if polls else "engine_wait")
        self._sender.start()

    def log_decisions(self, step: ForwardStep) -> None:
        """One route_decision line per request and decode process, a step's in one write
        (once the step's sends finished)."""
        groups = []
        rank = self.rank
        for link, send in step.sends:  # what a send's requests share, rendered once
            shared = json.dumps({"decode": link.name, "send": {
                "requests": len(send.transfers), "blocks": send.blocks, "bytes": send.nbytes},
                "latency_us": round(send.latency_us, 2), "outcome": "ok" if send.error is None else "error",
                "error": send.error})[1:-1]
            groups.append(([f'"rank": {rank}, "rid": {t.rid}, "room": {t.room}, "slot": {t.src_slot}, '
                            f'"dst_slot": {t.dst_slot}' for t in send.transfers], shared))
        self.decisions.write_groups(groups)

    # ---- the workload -------------------------------------------------------------------
    def run(self, phase: PhaseSpec, conn: Optional[control.Pipe],
            faults: Optional[LoopFaults] = None) -> RankResult:
        """Run one phase to the end; returns what it measured. `faults`: the fault hooks
        with the runner to ask (default: the configured fault's, its checkpoint unarmed)."""
        spec = self.spec
        settings = LoopSettings(self.rank, spec.workload, self.plan.route.value, spec.max_inflight_blocks,
                                self.records_path, self.memory, self.log)
        return PrefillLoop(self.links, self.rows, self.sender, settings, phase, conn,
                           faults or LoopFaults(spec.faults, self.rank)).run()

    def close(self) -> None:
        # what is still in flight (the loop's too) is finished by the thread, within timeout_s
        if self._sender is not None and not self._sender.close(self.spec.timeout_s):
            self.log.warning("sender_stuck", detail="a write never returned from the engine")
            self.stuck = True
            return
        self.links.close()
        self.decisions.close()
        self.ctx.term()


def workload_driver(endpoint: PrefillEndpoint, conn: control.Pipe) -> RankResult:
    """The default driver: the configured workload, once."""
    spec = endpoint.spec
    faults = LoopFaults(spec.faults, endpoint.rank, lambda kind: _ask_runner(conn, kind))
    return endpoint.run(PhaseSpec.of(spec, endpoint.rank), conn, faults)


def _ask_runner(conn: control.Pipe, kind: str) -> None:
    """A process fault: the runner acts (kill, stop) and answers; wait for it."""
    conn.send(control.FaultReached(kind=kind))
    while not isinstance(conn.recv(), control.FaultDone):
        pass


Driver = Callable[[PrefillEndpoint, control.Pipe], PrefillResult]
"""What a prefill rank runs once bootstrapped, and sends back (default: workload_driver; the
bench's: sweep.bench.BenchDriver). orchestrator.job.children.prefill_main runs it."""
