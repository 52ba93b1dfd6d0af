"""Can the peer reach the address this side would advertise to SGLang?

In a split run (role=prefill / role=decode) each side works out the address SGLang 0.5.23
would advertise on its host (orchestrator.profile.address: SGLANG_HOST_IP / HOST_IP,
SGLANG_LOCAL_IP_NIC, the default route, the hostname), listens on it (:class:`Echo`, a ZMQ
ROUTER on a port of its own that answers a sealed nonce with the same nonce sealed back),
and sends both at bootstrap (:func:`advertisement`). The peer then probes it before any
handoff (:func:`probe`: a ZMQ connect; on the engine route, the first contact adds Mooncake's
``send_probe`` towards the Mooncake handshake port on that address:
orchestrator.handoff.backends.mooncake). A failure names the interface, the step of the rule
that chose it, and the variable to set (:func:`unreachable`).
This tool's own planes keep the declared transport.host: the probe says what SGLang would meet.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping, Optional

import zmq

from orchestrator.handoff.transport.auth import Authenticator, new_nonce
from orchestrator.profile.address import NIC_VAR, advertise, probe_host

PROBE_BYTES = 256  # a sealed 32-character nonce and its MAC fit


def advertisement(env: Mapping[str, str], reached_at: str) -> dict[str, Any]:
    """What this side tells its peer: the address SGLang would advertise here, the step and
    the interface, and the fix should the peer not reach it (`reached_at`: this side's
    transport.host, which the peer does reach: its interface is the one to name)."""
    host = probe_host(env)
    adv = advertise(host)
    there = host.interface_of(reached_at)
    fix = (f"{NIC_VAR}={there.name} (or SGLANG_HOST_IP={reached_at})" if there is not None
           else f"SGLANG_HOST_IP={reached_at}")
    return {"address": adv.address or "", "step": adv.step.value, "interface": adv.interface or "",
            "port": 0, "fix": fix, "error": adv.error or ""}


class Echo:
    """A ZMQ ROUTER on `address` (a random port) answering each authentic probe, in a thread."""

    def __init__(self, address: str, auth: Authenticator):
        self.auth = auth
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, PROBE_BYTES)
        try:
            self.port = self.sock.bind_to_random_port(f"tcp://{address}")
        except zmq.ZMQError:
            self.sock.close(0)
            self.ctx.term()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="reach-echo", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.sock.poll(50):
                    continue
                frames = self.sock.recv_multipart()
            except zmq.ZMQError:
                return
            body = self.auth.unseal(frames[-1]) if len(frames) == 2 else None
            if body is not None and len(body) == 32:
                try:
                    self.sock.send_multipart([frames[0], self.auth.seal(body)], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.sock.close(0)
        self.ctx.term()


def listen(adv: dict[str, Any], auth: Authenticator) -> Optional[Echo]:
    """The echo on the advertised address (its port set in `adv`); None, with adv["error"]
    set, when the address is not this host's (SGLANG_HOST_IP naming another host, say)."""
    if not adv["address"] or adv["error"]:
        return None
    try:
        echo = Echo(adv["address"], auth)
    except zmq.ZMQError as exc:
        adv["error"] = f"cannot listen on {adv['address']} ({exc}): not an address of this host"
        return None
    adv["port"] = echo.port
    return echo


def probe(adv: Mapping[str, Any], auth: Authenticator, timeout_s: float) -> Optional[str]:
    """A ZMQ connect to the peer's advertised address and one sealed round trip; None when it
    answered within `timeout_s`, else why not."""
    if adv.get("error"):
        return str(adv["error"])
    if not adv.get("address") or not adv.get("port"):
        return "no address advertised"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, PROBE_BYTES)
    endpoint = f"tcp://{adv['address']}:{adv['port']}"
    try:
        sock.connect(endpoint)
        nonce = new_nonce().encode()
        sock.send(auth.seal(nonce))
        if sock.poll(int(timeout_s * 1000)):
            if auth.unseal(sock.recv()) == nonce:
                return None
            return f"{endpoint} answered, but not with our nonce"
        return f"no answer from {endpoint} within {timeout_s:g} s (ZMQ connect)"
    except zmq.ZMQError as exc:
        return f"{endpoint}: {exc}"
    finally:
        sock.close(0)
        ctx.term()


def unreachable(side: str, adv: Mapping[str, Any], why: str) -> str:
    """The one line a failure says: which side, which address and interface, which step of
    SGLang's rule chose it, and the variable to set on that side."""
    where = f" on {adv['interface']}" if adv.get("interface") else ""
    return (f"the {side} side would advertise {adv.get('address') or 'no address'}{where} to SGLang "
            f"(step {adv.get('step')} of SGLang 0.5.23's get_local_ip_auto), which its peer cannot "
            f"reach: {why}; set {adv.get('fix')} on the {side} side")


def environment() -> dict[str, str]:
    return dict(os.environ)
