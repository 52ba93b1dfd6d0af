"""The peer checks of a split run's bootstrap (role=prefill's lookup, role=decode's answer).

Each side sends what it runs (orchestrator.profile.versions: the Mooncake wheel and version,
torch, the SGLang layout, this tool's version) and the address SGLang 0.5.23 would advertise on
its host, with a port it listens on there (orchestrator.handoff.transport.reach). Each side
then judges the peer's before any handoff:

- versions: a known incompatibility (Mooncake across 0.3.11) ends the run; any other skew is
  a warning;
- the address: a ZMQ probe of it (transport.address_check: fail ends the run, naming the
  interface and the variable to set on the side that advertises it; warn makes it a warning;
  off skips it). Once it answered, the prefill endpoints (which hold an engine) also probe the
  decode's Mooncake handshake port on that address with Mooncake's send_probe (the decode
  sides' DecodeAdverts carry it as `advertised`; feature-detected: an older wheel lacks it).

Warnings land in RunResult.warnings (the summary and results.json); a failure is the reason
`judge` returns (the bootstrap refuses on it: bootstrap.RunFailed). What a side reads of
the run is its BootstrapSpec (orchestrator.handoff.specs).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, TypedDict

from orchestrator.handoff.specs import BootstrapSpec
from orchestrator.handoff.transport import reach, wire
from orchestrator.handoff.transport.advert import Advertisement
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.profile import versions
from orchestrator.profile.kinds import AddressCheck
from orchestrator.profile.versions import Versions
from orchestrator.results.records import RunResult

PROBE_S = 3.0  # at most this long (and at most transport.timeout_s) for the address probe


class PeerFields(TypedDict):
    """What a side sends of itself in its lookup or its answer (keyword arguments of
    wire.LookupMsg and wire.DecodesMsg)."""

    versions: Versions
    advertised: Advertisement


class PeerCheck:
    """One side's part: what it sends (`fields()`), and its verdict on the peer's (`judge`)."""

    def __init__(self, spec: BootstrapSpec, side: str, auth: Authenticator, log: Any,
                 env: Optional[Mapping[str, str]] = None) -> None:
        """`spec`: what the run's bootstrap reads (transport.host, timeout_s and address_check,
        layout.name); `auth`: this side's (its echo's and its probe's seals)."""
        self.side, self.log = side, log
        self.timeout_s = spec.timeout_s
        self.auth = auth
        self.mode = spec.address_check
        self.versions = versions.local(spec.layout)
        self.advertised = Advertisement.off()
        self.echo: Optional[reach.Echo] = None
        self.reached: Optional[Advertisement] = None  # the peer's advertisement, once probed fine
        if self.mode is not AddressCheck.off:
            adv = reach.advertisement(env if env is not None else reach.environment(), spec.host)
            self.echo = reach.listen(adv, self.auth)  # (sets its port, or its error)
            self.advertised = Advertisement.from_json(adv)
            log.info("address_advertised", side=side, **adv)

    def fields(self) -> PeerFields:
        """This side's part of its lookup or its answer (the message's keyword arguments)."""
        return {"versions": self.versions, "advertised": self.advertised}

    def judge(self, msg: wire.LookupMsg | wire.DecodesMsg, out: RunResult) -> Optional[str]:
        """The peer's fields: None when the run may go on (warnings added to `out`), else the
        reason it may not."""
        peer = "decode" if self.side == "prefill" else "prefill"
        theirs = msg.versions
        if theirs is not None and theirs != Versions():  # (a peer may say nothing: {})
            self.log.info("peer_versions", side=self.side, mine=versions.as_text(self.versions),
                          peer=versions.as_text(theirs))
            for fail, text in versions.skew(self.versions, theirs):
                line = f"versions: {text}"
                if fail:
                    return line
                out.warnings.append(line)
                self.log.warning("version_skew", detail=text)
        adv = msg.advertised
        if self.mode is AddressCheck.off or adv is None or not adv.checked:
            return None
        why = reach.probe(adv.to_json(), self.auth, min(PROBE_S, self.timeout_s))
        if why is None:
            self.log.info("peer_address_reached", peer=peer, address=adv.address, port=adv.port, step=adv.step)
            self.reached = adv
            return None
        line = reach.unreachable(peer, adv.to_json(), why)
        self.log.warning("peer_address_unreachable", detail=line)
        if self.mode is AddressCheck.fail:
            return line + " (transport.address_check=fail)"
        out.warnings.append(line)
        return None

    def close(self) -> None:
        if self.echo is not None:
            self.echo.close()
            self.echo = None

