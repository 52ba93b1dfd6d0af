"""Prefill endpoint (sender), shaped like SGLang's prefill scheduler.

A request is announced to its decode instance when it ARRIVES ("arrive", in bulk); decode
grants it a slot then, as SGLang's decode pre-allocates while the request bootstraps, so a
finished prefill never waits for a grant. Granted requests are taken `workload.batch_size`
at a time by a forward step, which

  1. fills each request's row (inline: SGLang's set_buf, timed per request as set_buf_us;
     ahead: every slot was filled before the timed phase, a request writes its room only),
  2. takes one digest pass over the whole step on the buffers' device (orchestrator.handoff.digest)
     and writes each tag into the row's kv_checksum field where the layout has one,
  3. hands the step to the transfer thread and goes on with the next step.

The transfer thread runs the sends (orchestrator.handoff.backends: one batch write per request, or per
run of consecutive slots) and the status messages, overlapping with the next step's fill as
SGLang's transfer workers overlap its scheduler. Verdicts come back in batches. A decode
instance silent for `transport.timeout_s` while it owes us something is declared lost; its
requests fail with a reason, and the run goes on with the others. The other way round, the
loop tells every live instance something (an empty arrive when nothing else is due) at least
every min(1 s, timeout_s/4): a role=decode side, which cannot see this process, declares a
prefill rank silent for timeout_s lost even when it holds nothing of it.

Requests are identified by (prefill rank, request id) everywhere, never by room: duplicate
rooms (retries, n>1 sampling) each get their own slot and verdict.

Where the parts live: the hello/bootstrap exchange in endpoints.handshake, the decodes and
the control channel in endpoints.links, the transfer thread and its ForwardStep in
endpoints.sender, a phase's main loop in endpoints.prefill_loop; this module builds them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Optional

import structlog
import torch
import zmq

from orchestrator.handoff.backends.base import Backend
from orchestrator.handoff.buffers import MetadataBuffers, SlotAllocator, StagedRows
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.endpoints.common import (
    build_side,
    process_gpu,
    report_failure,
    shapes,
    start_process,
)
from orchestrator.handoff.endpoints.handshake import PrefillHandshake
from orchestrator.handoff.endpoints.links import Credentials, Instance, Links
from orchestrator.handoff.endpoints.prefill_loop import LoopSettings, PhaseSpec, PrefillLoop, SourceRows
from orchestrator.handoff.endpoints.sender import ForwardStep, Sender
from orchestrator.handoff.faults import LoopFaults
from orchestrator.handoff.transport.auth import Authenticator, new_nonce
from orchestrator.handoff.workload import RequestPool
from orchestrator.job import protocol, warmstart
from orchestrator.profile.config import (
    BuffersConfig,
    EndpointsConfig,
    FaultsConfig,
    LayoutConfig,
    OrchestratorConfig,
    TransportConfig,
    VerifyConfig,
    WorkloadConfig,
)
from orchestrator.profile.kinds import CompletionSetting
from orchestrator.profile.plan import Plan
from orchestrator.profile.platform import boot_id, usable_cores
from orchestrator.results.logs import DecisionLog
from orchestrator.results.records import RankResult
from orchestrator.results.rundir import RunFile, RunFiles, proc_name


@dataclass(frozen=True)
class PrefillConfig:
    """The config sections a prefill rank reads (prefill_main picks them out)."""

    buffers: BuffersConfig
    layout: LayoutConfig
    transport: TransportConfig
    workload: WorkloadConfig
    endpoints: EndpointsConfig
    verify: VerifyConfig
    faults: FaultsConfig
    max_batch: int  # the largest step a phase takes: workload.batch_size, or bench.batch_size


class PrefillEndpoint:
    # the tag travels in the (authenticated) status even when the row carries it too: the
    # decode then tells a row written by someone else from one corrupted on the way
    TAG_IN_STATUS = True

    def __init__(self, c: PrefillConfig, plan: Plan, run_dir: Path, log: structlog.stdlib.BoundLogger,
                 rank: int, secret: bytes):
        self.config, self.plan, self.log, self.rank = c, plan, log, rank
        self.workload = c.workload
        self.name = proc_name("prefill", rank, c.endpoints.prefill_ranks)
        self.side = build_side(c.buffers, c.layout, c.transport, plan, self.name, run_dir, log,
                               process_gpu(plan, "prefill", rank))
        buffers = self.side.buffers
        src = SlotAllocator(c.buffers.size)
        nonce = new_nonce()
        self.me = Credentials(Authenticator(secret), nonce, Keys(secret, nonce), boot_id())
        digest = RowDigest(buffers, self.me.keys, c.verify.digest)
        device_rows = buffers.device.type == "cuda"
        # buffers.set_buf=staged (a phase's choice): SGLang's set_buf into pinned host rows,
        # one upload a step (device rows; on host rows both modes are SGLang's set_buf)
        staged = StagedRows(buffers) if device_rows else None
        buffers.warm()  # start-up pays the device's first-use costs, not request 1
        digest.warm_seal(c.max_batch, staged)
        warmstart.mark("warm-up")
        # Mooncake's intra-node NVLink transport records an event on the submitting thread's
        # per-thread stream and waits for it before it copies; work on the legacy default
        # stream (torch's default) is ordered before that event, so a step's row writes land
        # before the engine reads them without a wait of ours (tests/test_gpu.py shows it).
        # Elsewhere the step syncs its stream once.
        engine_orders_writes = bool(
            device_rows and self.side.transport == "mooncake-nvlink_intra"
            and torch.cuda.current_stream(buffers.device).cuda_stream == 0)
        log.info("step_ordering", engine_orders_writes=engine_orders_writes,
                 set_buf=c.buffers.set_buf.value)
        pool = RequestPool(c.workload, shapes(c.buffers, buffers))
        self.rows = SourceRows(buffers, src, pool, digest, self.me.keys, staged, engine_orders_writes)
        self.ctx = zmq.Context()
        self.links = Links(self.ctx, self.me, log, c.transport.timeout_s)
        self.memory: dict[str, int] = {}
        self.stuck = False  # a Mooncake call that never returned: exit hard
        self.bulk_ptr: Optional[int] = None  # the benchmark's bandwidth target (connect())
        files, ranks = RunFiles(run_dir), c.endpoints.prefill_ranks
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
        """The transfer thread (connect() starts it)."""
        assert self._sender is not None, "connect() first"
        return self._sender

    # ---- bootstrap ----------------------------------------------------------------------
    def connect(self, decodes: list[list[dict]]) -> None:
        """Bootstrap with every decode rank (orchestrator.handoff.endpoints.handshake), then
        start the transfer thread."""
        c = self.config
        self.bulk_ptr = decodes[0][0].get("bulk_ptr")
        handshake = PrefillHandshake(self.links, self.side, self.plan, self.rank, c.faults, self.TAG_IN_STATUS,
                                     c.transport.address_check)
        try:
            handshake.connect(decodes)
        finally:
            self.stuck = self.stuck or handshake.stuck
        spin = c.endpoints.poll.spins(usable_cores())
        nap_s = (c.transport.mooncake.nap_us / 1e6
                 if self.plan.completion is CompletionSetting.nap else 0.0)
        self._sender = Sender(self.ctx, self.links.wake_addr, self.log_decisions, nap_s,
                              c.transport.max_inflight_sends, self.buffers.device, spin)
        self.log.info("prefill_loop", transfer_thread="spin" if spin else "block")
        self._sender.start()

    def log_decisions(self, step: ForwardStep) -> None:
        """One route_decision line per request and decode process, a step's in one write
        (transfer thread)."""
        lines = []
        rank = self.rank
        for link, send in step.sends:  # what a send's requests share, rendered once
            shared = json.dumps({"decode": link.name, "send": {
                "requests": len(send.transfers), "blocks": send.blocks, "bytes": send.nbytes},
                "latency_us": round(send.latency_us, 2), "outcome": "ok" if send.error is None else "error",
                "error": send.error})[1:-1]
            lines += [f'"rank": {rank}, "rid": {t.rid}, "room": {t.room}, "slot": {t.src_slot}, '
                      f'"dst_slot": {t.dst_slot}, {shared}' for t in send.transfers]
        self.decisions.write_fields(lines)

    # ---- the workload -------------------------------------------------------------------
    def run(self, phase: PhaseSpec, conn: Optional[protocol.Channel],
            faults: Optional[LoopFaults] = None) -> RankResult:
        """Run one phase to the end; returns what it measured. `faults`: the fault hooks
        with the runner to ask (default: the configured fault's, its checkpoint unarmed)."""
        c = self.config
        settings = LoopSettings(self.rank, c.workload, self.plan.route.value, c.transport.max_inflight_blocks,
                                self.records_path, self.memory, self.log)
        return PrefillLoop(self.links, self.rows, self.sender, settings, phase, conn,
                           faults or LoopFaults(c.faults, self.rank)).run()

    def close(self) -> None:
        if self._sender is not None and self._sender.is_alive():
            self._sender.submit(None)
            self._sender.join(self.config.transport.timeout_s)
            if self._sender.is_alive():  # blocked inside the engine (an unreachable peer)
                self.log.warning("sender_stuck", detail="a write never returned from the engine")
                self.stuck = True
                return
        self.links.close()
        self.decisions.close()
        self.ctx.term()


def workload_driver(endpoint: PrefillEndpoint, conn: protocol.Channel) -> RankResult:
    """The default driver: the configured workload, once."""
    c = endpoint.config
    faults = LoopFaults(c.faults, endpoint.rank, lambda kind: _ask_runner(conn, kind))
    return endpoint.run(PhaseSpec.of(c.workload, c.transport, c.buffers.set_buf, endpoint.rank), conn, faults)


def _ask_runner(conn: protocol.Channel, kind: str) -> None:
    """A process fault: the runner acts (kill, stop) and answers; wait for it."""
    conn.send(protocol.FaultReached(kind=kind))
    while not isinstance(conn.recv(), protocol.FaultDone):
        pass


Driver = Callable[[PrefillEndpoint, protocol.Channel], object]
"""What a prefill rank runs and sends back (default: workload_driver; the bench's paths:
sweep.bench.BenchDriver)."""


def prefill_main(cfg: OrchestratorConfig, plan: Plan, run_dir: str, secret: bytes, conn: Connection,
                 rank: int = 0, driver: Driver = workload_driver) -> None:
    """Process entry (multiprocessing spawn) of prefill rank `rank`: build buffers and
    engine (in parallel with the decode side), wait for the decode endpoints, bootstrap,
    run `driver(endpoint, conn)` and send back what it returns. `conn` is this process's
    end of the runner's pipe; it carries protocol messages only."""
    chan = protocol.Channel(conn)
    run_path = Path(run_dir)
    name = proc_name("prefill", rank, cfg.endpoints.prefill_ranks)
    log = start_process(name, run_path, cfg.logging.console)
    sections = PrefillConfig(cfg.buffers, cfg.layout, cfg.transport, cfg.workload, cfg.endpoints, cfg.verify,
                             cfg.faults, max(cfg.workload.batch_size, cfg.bench.batch_size))
    endpoint = None
    try:
        endpoint = PrefillEndpoint(sections, plan, run_path, log, rank, secret)
        chan.send(protocol.Up(transport=endpoint.side.transport))
        msg = chan.recv()
        if not isinstance(msg, protocol.Decodes):
            return  # the run ended before it started (a stop, or a refused bootstrap)
        warmstart.mark("waiting")
        endpoint.connect(msg.infos)
        warmstart.mark("bootstrap")
        chan.send(protocol.Running())
        chan.send(protocol.Result(result=driver(endpoint, chan)))
    except Exception as exc:
        chan.send(protocol.Error(line=report_failure(log, "prefill_failed", exc)))
    finally:
        if endpoint is not None and not endpoint.stuck:
            endpoint.close()  # sets `stuck` if the transfer thread never comes back
        if endpoint is not None and endpoint.stuck:
            import os

            os._exit(1)  # a Mooncake call is still blocked inside the engine: do not wait on it
