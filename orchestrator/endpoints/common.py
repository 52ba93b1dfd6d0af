"""What both endpoint processes do before the first request: logging, device, buffers,
engine, and the check that the transport Mooncake brought up is the one the plan declared."""

from __future__ import annotations

import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import structlog
import torch

from ..buffers import MetadataBuffers
from ..config import FallbackPolicy, OrchestratorConfig
from ..logs import configure
from ..plan import Device, Plan, Route
from ..transport.engine import MooncakeEngine, exposed, listening_sockets


class TransportMismatch(RuntimeError):
    """The engine came up on another transport than declared (and fallback is strict)."""


@dataclass
class Side:
    buffers: MetadataBuffers
    engine: Optional[MooncakeEngine]
    transport: str  # effective: "zmq-tcp" or "mooncake-<transport>"
    log: structlog.stdlib.BoundLogger


def start_process(role: str, run_dir: Path) -> structlog.stdlib.BoundLogger:
    """Send this process's fd 2 (glog, warnings) to <role>.stderr.log; structured logs go
    to <role>.log and the console."""
    err = open(run_dir / f"{role}.stderr.log", "ab", buffering=0)
    os.dup2(err.fileno(), 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    torch.set_num_threads(1)  # two endpoints share the machine; row ops are tiny
    return configure(run_dir, role, console_level=30)


def role_name(kind: str, rank: int, ranks: int) -> str:
    """"prefill"/"decode" for a single rank, "prefill0", "decode3", ... otherwise; names the
    process's log files."""
    return kind if ranks == 1 else f"{kind}{rank}"


def rank_gpu(plan: Plan, kind: str, rank: int) -> Optional[int]:
    gpus = plan.prefill_gpus if kind == "prefill" else plan.decode_gpus
    return gpus[rank] if gpus else None


def build_side(cfg: OrchestratorConfig, plan: Plan, role: str, run_dir: Path,
               log: structlog.stdlib.BoundLogger, gpu: Optional[int] = None) -> Side:
    if plan.buffer_device is Device.cuda:
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    b = cfg.buffers
    buffers = MetadataBuffers(b.size, b.hidden_size, b.hidden_states_dtype.value,
                              b.max_top_logprobs_num, None, b.output_dsa_topk_indices_dim,
                              device=device)
    engine = None
    transport = "zmq-tcp"
    if plan.route is Route.engine:
        mc = cfg.transport.mooncake
        engine = MooncakeEngine(cfg.transport.host, mc.metadata_server, plan.protocol,
                                mc.device_name, env=plan.mc_env,
                                log_path=str(run_dir / f"{role}.mooncake.log"))
        engine.register(buffers.arena_ptr, buffers.arena_bytes)
        effective = engine.effective_transport
        transport = f"mooncake-{effective.value if effective else 'unknown'}"
        listeners = listening_sockets()
        log.info("engine_up", session_id=engine.session_id, protocol=plan.protocol,
                 mc_env=engine.applied_env, declared=plan.declared_transport,
                 effective=transport, listeners=listeners)
        if exposed(listeners) and ipaddress.IPv4Address(cfg.transport.host).is_loopback:
            log.info("engine_listens_beyond_loopback", listeners=exposed(listeners),
                     detail="Mooncake binds its handshake and TCP listeners on all "
                            "interfaces; firewall them or run in a network namespace")
        if transport != plan.declared_transport:
            msg = (f"{role}: Mooncake came up on {transport}, declared {plan.declared_transport} "
                   f"(MC env {engine.applied_env})")
            if plan.fallback is FallbackPolicy.strict:
                raise TransportMismatch(msg + "; set transport.fallback=degrade to run anyway")
            log.warning("fallback", reason="effective_transport_differs", detail=msg)
    log.info("buffers_ready", device=str(device), slots=b.size, row_bytes=buffers.row_bytes,
             item_lens=buffers.item_lens)
    return Side(buffers, engine, transport, log)


def rss_kb() -> int:
    """Resident set size of this process in KiB (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def new_socket(ctx, kind: int, timeout_s: float):
    """A socket that never blocks forever and never lingers at close."""
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    return sock
