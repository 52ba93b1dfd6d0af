"""What every endpoint process does before the first request: signals, logging, device,
buffers and the backend over them (orchestrator.handoff.backends)."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import structlog
import torch
import zmq

from orchestrator.handoff.backends.base import Backend
from orchestrator.handoff.backends.factory import open_backend
from orchestrator.handoff.buffers import MetadataBuffers
from orchestrator.handoff.endpoints import control
from orchestrator.handoff.specs import BufferSpec, LayoutSpec, SideSpec
from orchestrator.handoff.transport.wire import CONTROL_FRAME_BYTES
from orchestrator.handoff.workload import Shapes
from orchestrator.profile.plan import Device, Plan
from orchestrator.results.logs import configure
from orchestrator.results.rundir import RunFiles, open_regular

# Python's thread switch interval in an endpoint process. The transfer thread wakes from each
# Mooncake write needing the GIL back: at Python's default 5 ms it would wait behind the
# scheduler thread for that long; 0.2 ms lets it in within a fraction of a write.
SWITCH_INTERVAL_S = 0.0002


class Shutdown:
    """Set by SIGTERM in an endpoint process; the loops look at it and wind down."""

    requested = False


@dataclass
class Side:
    """A process's buffers and the backend that carries their rows."""

    buffers: MetadataBuffers
    backend: Backend
    log: structlog.stdlib.BoundLogger

    @property
    def transport(self) -> str:
        """Effective: "zmq-tcp" or "mooncake-<transport>"."""
        return self.backend.transport


def start_process(role: str, run_dir: Path, console: bool = False) -> structlog.stdlib.BoundLogger:
    """An endpoint process: Ctrl-C is the runner's to handle (the terminal sends SIGINT to
    every process of the group), SIGTERM winds the loop down; fd 2 (glog, warnings) goes to
    <role>.stderr.log; structured logs to <role>.log."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: setattr(Shutdown, "requested", True))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # see lifecycle.spawn
    err = open(open_regular(RunFiles(run_dir).stderr_log(role), os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab",
               buffering=0)  # a link or FIFO planted there: refused, never followed
    os.dup2(err.fileno(), 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    torch.set_num_threads(1)  # endpoints share the machine; row ops are tiny
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return configure(run_dir, role, console_level=30 if not console else 20)


def report_failure(log: structlog.stdlib.BoundLogger, event: str, exc: BaseException) -> str:
    """An endpoint's fatal error: one line for the console and the runner, the traceback in
    the process's log file only. A full disk is `NoSpace: no space left writing FILE`
    (rundir.no_space_line), which the runner ends the run on with exit 3."""
    import traceback

    from orchestrator.results.rundir import no_space_line

    full = no_space_line(exc)
    line = full or f"{type(exc).__name__}: {exc}".splitlines()[0]
    (log.info if full else log.error)(event, error=line)  # a full disk: the runner's line only
    log.info(f"{event}_traceback", traceback=traceback.format_exc())
    return line


def process_gpu(plan: Plan, kind: str, index: int) -> Optional[int]:
    gpus = plan.prefill_gpus if kind == "prefill" else plan.decode_gpus
    return gpus[index] if gpus else None


def make_buffers(b: BufferSpec, layout: LayoutSpec, device: torch.device) -> MetadataBuffers:
    """A process's MetadataBuffers, shaped by its buffers' spec and layout."""
    return MetadataBuffers(b.size, b.hidden_size, b.hidden_states_dtype.value, b.max_sampling_mask_tokens,
                           b.max_top_logprobs_num, None, b.output_dsa_topk_indices_dim,
                           kv_checksum_enabled=b.kv_checksum_enabled,
                           enable_sampling_mask=b.enable_sampling_mask, layout=layout,
                           device=device)


def shapes(b: BufferSpec, buffers: MetadataBuffers) -> Shapes:
    """The synthetic requests' shapes for these buffers (their spec)."""
    return Shapes(b.hidden_size, getattr(torch, b.hidden_states_dtype.value),  # what the buffers hold
                  b.output_dsa_topk_indices_dim, b.max_sampling_mask_tokens, str(buffers.device))


def build_side(spec: SideSpec, plan: Plan, role: str, run_dir: Path, log: structlog.stdlib.BoundLogger,
               gpu: Optional[int] = None) -> Side:
    """A process's buffers on its device and the plan's backend over them (the engine route:
    its engine with the buffers registered and the transport it came up on checked against
    the plan's, orchestrator.handoff.backends.mooncake)."""
    if plan.buffer_device is Device.cuda:
        torch.cuda.set_device(gpu)
        device = torch.device("cuda") if gpu is None else torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    b, layout = spec.buffers, spec.layout
    buffers = make_buffers(b, layout, device)
    control.mark("buffers")
    backend = open_backend(buffers, plan, spec.engine, role, run_dir, log, control.mark)
    log.info("buffers_ready", device=str(device), slots=b.size, row_bytes=buffers.row_bytes,
             item_lens=buffers.item_lens, layout=layout.name)
    return Side(buffers, backend, log)


def heartbeat_s(timeout_s: float) -> float:
    """How often a side with nothing else to send says something to its peer: well inside the
    peer's transport.timeout_s (the decode's empty update, the prefill's empty arrive)."""
    return max(0.05, min(1.0, timeout_s / 4))


def rss_kb() -> int:
    """Resident set size of this process in KiB (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def new_socket(ctx: zmq.Context, kind: int, timeout_s: float, max_bytes: Optional[int] = None) -> zmq.Socket:
    """A socket that never blocks forever, never lingers at close, and takes no frame
    longer than `max_bytes` (ZMQ_MAXMSGSIZE, default: a control message): libzmq drops a
    peer announcing a longer one before it buffers a byte of it."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_bytes or CONTROL_FRAME_BYTES))
    return sock


def bind_random(sock: zmq.Socket, host: str) -> str:
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
