"""What a side tells about itself before any handoff: a decode process's endpoints
(`DecodeAdvert`) and the address SGLang would advertise on a split run's host
(`Advertisement`).

A DecodeAdvert is one type from end to end: the decode process builds it when it is up
(protocol.Ready), the runner hands them to the prefills (protocol.Decodes), role=decode's
bootstrap serves their public part (wire.DecodesMsg: `public()`, four keys on the wire) and
role=prefill's lookup reads them back. wire.decode checks a received one field by field and
builds it there, once (`from_json`); everywhere else its fields are attributes.
No heavy imports here (no numpy, zmq or torch): the runner's pipe messages are made of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

JsonValue = Union[str, int, None]  # a value of these objects' JSON form


@dataclass(frozen=True)
class Advertisement:
    """The address SGLang 0.5.23 would advertise on the sender's host, the step of its rule
    that chose it, the interface, a port the sender listens on there (0: none), the fix to
    set should the peer not reach it, and why there is none (orchestrator.handoff.transport.
    reach). `checked` False: the sender does not check addresses ({} on the wire)."""

    address: str = ""
    step: str = ""
    interface: str = ""
    port: int = 0
    fix: str = ""
    error: str = ""
    checked: bool = True  # (not on the wire: {} says False)

    WIRE_KEYS = ("address", "step", "interface", "port", "fix", "error")

    @classmethod
    def off(cls) -> "Advertisement":
        """What a side that does not check addresses (transport.address_check=off) sends."""
        return cls(checked=False)

    @classmethod
    def from_json(cls, d: dict[str, JsonValue]) -> "Advertisement":
        """A JSON object that passed wire's check ({} or every key of WIRE_KEYS), or the one
        reach.advertisement made here."""
        if not d:
            return cls.off()
        return cls(str(d["address"]), str(d["step"]), str(d["interface"]), int(d["port"] or 0),
                   str(d["fix"]), str(d["error"]))

    def to_json(self) -> dict[str, JsonValue]:
        """Its JSON object on the wire, keys in the order they have always been sent."""
        if not self.checked:
            return {}
        return {"address": self.address, "step": self.step, "interface": self.interface, "port": self.port,
                "fix": self.fix, "error": self.error}


@dataclass(frozen=True)
class DecodeAdvert:
    """One decode process (a TP rank of a decode instance) as it came up: its control and
    data endpoints, its effective transport and its engine session (None: no engine). The
    rest never travels between hosts: the listeners its engine opened beyond loopback and the
    bench's bulk target (this host's runner reads them), and, on the prefill side of a split
    run, the decode side's Advertisement once its ZMQ probe answered (the prefill endpoints
    probe its Mooncake port there too)."""

    control_endpoint: str
    data_endpoint: str
    transport: str
    session_id: Optional[str]
    engine_exposed: tuple[str, ...] = ()
    bulk_ptr: Optional[int] = None
    advertised: Optional[Advertisement] = None

    WIRE_KEYS = ("control_endpoint", "data_endpoint", "transport", "session_id")

    def public(self) -> "DecodeAdvert":
        """What role=decode's bootstrap serves: the endpoints only."""
        return DecodeAdvert(self.control_endpoint, self.data_endpoint, self.transport, self.session_id)

    @classmethod
    def from_json(cls, d: dict[str, JsonValue]) -> "DecodeAdvert":
        """A JSON object that passed wire's check (exactly WIRE_KEYS, strings; session_id
        may be null)."""
        session = d["session_id"]
        return cls(str(d["control_endpoint"]), str(d["data_endpoint"]), str(d["transport"]),
                   None if session is None else str(session))

    def to_json(self) -> dict[str, JsonValue]:
        """Its JSON object on the wire (the public part), keys in the order always sent."""
        return {"control_endpoint": self.control_endpoint, "data_endpoint": self.data_endpoint,
                "transport": self.transport, "session_id": self.session_id}

    def log_fields(self) -> dict[str, object]:
        """Its fields for the runner's decode_ready log line (the bulk target when set)."""
        bulk = {} if self.bulk_ptr is None else {"bulk_ptr": self.bulk_ptr}
        return {**self.to_json(), "engine_exposed": list(self.engine_exposed), **bulk}


Adverts = list[list[DecodeAdvert]]  # per decode instance, per TP rank
