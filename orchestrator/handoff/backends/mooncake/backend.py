"""The engine route in one endpoint process: its Mooncake engine, up with the plan's MC_*
environment, the buffers registered and the transport it came up on checked against the
declared one; the send paths it opens (EngineRouter); the first contact with each decode
(Mooncake's handshake, its probe of the address SGLang would advertise, the warm-up write,
on one watchdog); and the bench's raw calls."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import structlog
import torch
import zmq

from orchestrator.handoff.backends.base import Backend, RawWrites, SendPath
from orchestrator.handoff.backends.mooncake.engine import EngineError, MooncakeEngine, exposed, listening_sockets
from orchestrator.handoff.backends.mooncake.probe import bounded
from orchestrator.handoff.backends.mooncake.router import EngineRouter
from orchestrator.handoff.buffers import MetadataBuffers
from orchestrator.handoff.specs import EngineSpec
from orchestrator.handoff.transport.advert import Advertisement
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.handoff.transport.reach import unreachable
from orchestrator.profile.kinds import AddressCheck, FallbackPolicy, is_loopback
from orchestrator.profile.plan import Plan
from orchestrator.results.rundir import RunFiles


class TransportMismatch(RuntimeError):
    """The engine came up on another transport than declared (and fallback is strict)."""


@dataclass
class _Contact:
    """What the watchdog's thread found: the engine's handshake (and its probe of the address
    the decode's host would advertise), then the warm-up write."""

    ok: bool = False
    advertised_ok: bool = False
    warm_s: float = 0.0
    warm_error: Optional[str] = None


class MooncakeBackend(Backend):
    """One process's Mooncake engine and the send paths over it (start() brings it up)."""

    def __init__(self, buffers: MetadataBuffers, engine: MooncakeEngine, transport: str, max_blocks_per_batch: int):
        super().__init__(buffers)
        self.engine, self.transport, self.max_blocks = engine, transport, max_blocks_per_batch
        self.opened: list[EngineRouter] = []  # the send paths, in the order opened
        self._bulk: Optional[torch.Tensor] = None  # the bench's bandwidth target, kept alive

    @classmethod
    def start(cls, buffers: MetadataBuffers, spec: EngineSpec, plan: Plan, role: str, run_dir: Path,
              log: structlog.stdlib.BoundLogger, mark: Callable[[str], None]) -> MooncakeBackend:
        """The engine up, the buffers registered (then `mark("engine")`), the transport it came
        up on logged and checked against the plan's (TransportMismatch with fallback=strict)."""
        assert plan.protocol is not None, "the engine route has a protocol"
        engine = MooncakeEngine(spec.host, spec.metadata_server, plan.protocol, spec.device_name, env=plan.mc_env,
                                log_path=str(RunFiles(run_dir).mooncake_log(role)))
        engine.register(buffers.arena_ptr, buffers.arena_bytes)
        mark("engine")
        effective = engine.effective_transport
        transport = f"mooncake-{effective.value if effective else 'unknown'}"
        listeners = listening_sockets()
        log.info("engine_up", session_id=engine.session_id, protocol=plan.protocol,
                 declared=plan.declared_transport, effective=transport, listeners=listeners)
        if exposed(listeners) and is_loopback(spec.host):
            log.info("engine_listens_beyond_loopback", listeners=exposed(listeners),
                     detail="Mooncake binds its handshake and TCP listeners on all "
                            "interfaces; firewall them or run in a network namespace")
        if transport != plan.declared_transport:
            msg = (f"{role}: Mooncake came up on {transport}, declared {plan.declared_transport} "
                   f"(MC env {engine.applied_env})")
            if plan.fallback is FallbackPolicy.strict:
                raise TransportMismatch(msg + "; set transport.fallback=degrade to run anyway")
            log.warning("fallback", reason="effective_transport_differs", detail=msg)
        return cls(buffers, engine, transport, spec.max_blocks_per_batch)

    @property
    def session_id(self) -> Optional[str]:
        return self.engine.session_id

    def exposed(self) -> list[str]:
        return exposed(listening_sockets())

    def router(self, push: zmq.Socket, auth: Authenticator, prefill_rank: int,
               tag_in_status: bool = True) -> EngineRouter:
        path = EngineRouter(self.buffers, auth, prefill_rank, push, self.engine,
                            max_blocks_per_batch=self.max_blocks, tag_in_status=tag_in_status)
        self.opened.append(path)
        return path

    def first_contact(self, path: SendPath, advertised: Optional[Advertisement], timeout_s: float,
                      address_check: AddressCheck, log: structlog.stdlib.BoundLogger) -> float:
        """Mooncake's handshake with a peer that accepts and never answers blocks ~60 s and
        ignores its timeout variables: run it on a watchdog of `timeout_s`. Then the path's
        warm-up write, on the same watchdog; returns its seconds. `advertised`: the address
        SGLang would advertise on the decode's host (a split run's bootstrap, once its ZMQ
        probe answered): Mooncake's send_probe towards the same handshake port there."""
        assert isinstance(path, EngineRouter), "a path this backend opened"
        session = path.peer_session()
        host, _, port = session.rpartition(":")
        other = advertised.address if advertised is not None else None
        elsewhere = f"{other}:{port}" if other not in (None, "", host) else None
        result = self._contact(path, session, elsewhere, timeout_s)
        if not result.ok:
            raise RuntimeError(f"Mooncake probe of decode session {session} failed")
        if elsewhere is not None and not result.advertised_ok:
            assert advertised is not None
            line = unreachable("decode", advertised.to_json(), f"Mooncake send_probe to {elsewhere} "
                                                               "failed (its ZMQ probe had answered)")
            if address_check is AddressCheck.fail:
                raise RuntimeError(line)
            log.warning("peer_address_unreachable", detail=line)
        elif elsewhere is not None:
            log.info("peer_address_mooncake_probe", session=elsewhere, ok=True)
        if result.warm_error is not None:
            raise RuntimeError(f"the warm-up write to decode session {session} failed: "
                               f"{result.warm_error}")
        return result.warm_s

    def _contact(self, path: EngineRouter, session: str, elsewhere: Optional[str], timeout_s: float) -> _Contact:
        """The handshake (send_probe of `session`, then of `elsewhere`) and the warm-up write,
        in one thread given `timeout_s` (TimeoutError, `stuck` set, when it is still inside)."""
        result = _Contact()
        device = self.buffers.device

        def contact() -> None:
            result.ok = self.engine.probe(session)
            if not result.ok:
                return
            if elsewhere is not None:
                result.advertised_ok = self.engine.probe(elsewhere)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a new thread starts on device 0
            try:
                result.warm_s = path.warm()
            except EngineError as exc:
                result.warm_error = str(exc)

        if not bounded(contact, timeout_s):
            self.stuck = True
            raise TimeoutError(f"Mooncake handshake with decode session {session} did not finish "
                               f"within transport.timeout_s={timeout_s:g}: its engine listener "
                               f"{session} stalled (Mooncake serves handshakes one at a time, and "
                               "idle connections to that port from anyone hold it)")
        return result

    def raw(self) -> RawWrites:
        """Mooncake's own sync writes on the first path's blocks (decode instance 0, TP rank 0)."""
        path = self.opened[0]
        te = self.engine.raw
        return RawWrites(path, path.peer_session(), path.blocks, te.batch_transfer_sync_write,
                         te.transfer_sync_write, self.engine.register)

    def bulk_target(self, nbytes: int) -> int:
        self._bulk = torch.empty(nbytes, dtype=torch.uint8, device=self.buffers.device)
        self.engine.register(self._bulk.data_ptr(), nbytes)
        return self._bulk.data_ptr()
