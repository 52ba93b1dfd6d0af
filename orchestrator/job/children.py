"""The endpoint processes' entries: each takes its spec (orchestrator.handoff.specs, built once
by the job: orchestrator.job.specs), builds its endpoint and speaks the runner's pipe around
it (orchestrator.job.protocol). What crosses into a child is its spec, the run dir, the run's
secret and its end of the pipe, never the config.

A child is started by name (warmstart.child_main imports this module there, or the forkserver
already has): the runner itself never imports torch or Mooncake.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional

from orchestrator.handoff.endpoints import control
from orchestrator.handoff.endpoints.common import process_gpu, report_failure, start_process
from orchestrator.handoff.endpoints.decode import DecodeEndpoint
from orchestrator.handoff.endpoints.prefill import Driver, PrefillEndpoint, workload_driver
from orchestrator.handoff.endpoints.tp import Group, join
from orchestrator.handoff.specs import DecodeSpec, PrefillSpec
from orchestrator.job import protocol
from orchestrator.results.rundir import proc_name


def prefill_main(spec: PrefillSpec, run_dir: str, secret: bytes, conn: Connection, rank: int = 0,
                 driver: Driver = workload_driver) -> None:
    """Process entry (multiprocessing spawn) of prefill rank `rank`: build buffers and
    engine (in parallel with the decode side), wait for the decode endpoints, bootstrap,
    run `driver(endpoint, conn)` and send back what it returns. `conn` is this process's
    end of the runner's pipe; it carries protocol messages only."""
    chan = protocol.Channel(conn)
    run_path = Path(run_dir)
    log = start_process(proc_name("prefill", rank, spec.ranks), run_path, spec.console)
    endpoint = None
    try:
        endpoint = PrefillEndpoint(spec, run_path, log, rank, secret)
        chan.send(protocol.Up(transport=endpoint.side.transport))
        msg = chan.recv()
        if not isinstance(msg, protocol.Decodes):
            return  # the run ended before it started (a stop, or a refused bootstrap)
        control.mark("waiting")
        endpoint.connect(msg.infos)
        control.mark("bootstrap")
        chan.send(protocol.Running())
        chan.send(protocol.Result(result=driver(endpoint, chan)))
    except Exception as exc:
        chan.send(protocol.Error(line=report_failure(log, "prefill_failed", exc)))
    finally:
        if endpoint is not None and not endpoint.stuck:
            endpoint.close()  # sets `stuck` if the transfer thread never comes back
        if endpoint is not None and endpoint.stuck:
            os._exit(1)  # a Mooncake call is still blocked inside the engine: do not wait on it


def _join(spec: DecodeSpec, chan: protocol.Channel, run_path: Path, name: str, instance: int,
          tp_rank: int) -> Optional[Group]:
    """A decode TP rank joins its instance's group at the rendezvous the runner sends
    (endpoints.decode_tp=1: no group)."""
    if spec.tp == 1:
        return None
    match chan.recv():
        case protocol.Rendezvous() as rendezvous:
            pass
        case other:
            raise protocol.ProtocolError(f"a decode TP rank waits for Rendezvous, not {type(other).__name__}")
    return join(rendezvous, tp_rank, spec.tp, spec.timeout_s,
                process_gpu(spec.plan, "decode", instance * spec.tp + tp_rank), run_path / f"tp-{name}.jsonl")


def decode_main(spec: DecodeSpec, run_dir: str, secret: bytes, conn: Connection, instance: int = 0,
                tp_rank: int = 0, bulk_bytes: int = 0) -> None:
    """Process entry (multiprocessing spawn) of one decode process; `conn` is its end of the
    runner's pipe (orchestrator.job.protocol). `bulk_bytes` > 0 also registers a bulk target
    region of that size on the buffers' device (the benchmark's bandwidth point)."""
    run_path = Path(run_dir)
    chan = protocol.Channel(conn)
    name = proc_name("decode", instance, spec.ranks, tp_rank, spec.tp)
    log = start_process(name, run_path, spec.console)
    endpoint = None
    try:
        group = _join(spec, chan, run_path, name, instance, tp_rank)
        endpoint = DecodeEndpoint(spec, run_path, log, secret, instance, tp_rank, group)
        chan.send(protocol.Ready(endpoint.advert(bulk_bytes)))
        endpoint.serve(chan)
        chan.send(protocol.Stats(endpoint.res))
    except Exception as exc:  # reported to the runner, which owns the user-facing message
        line = report_failure(log, "decode_failed", exc)
        try:
            chan.send(protocol.Error(line))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if endpoint is not None:
            endpoint.close()
