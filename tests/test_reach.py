"""orchestrator.handoff.transport.reach: the echo a split run's side listens with on the
address SGLang would advertise, and the peer's probe of it (real ZMQ sockets on loopback;
the unreachable case across network namespaces: tests/test_address_netns.py)."""

from __future__ import annotations

from orchestrator.handoff.backends.mooncake.probe import mooncake_probe
from orchestrator.handoff.transport import reach
from orchestrator.handoff.transport.auth import Authenticator


def _adv(address: str) -> dict:
    return {"address": address, "step": "SGLANG_HOST_IP", "interface": "lo", "port": 0,
            "fix": "SGLANG_LOCAL_IP_NIC=eth1 (or SGLANG_HOST_IP=10.0.0.1)", "error": ""}


def test_a_listened_address_answers_the_probe_with_the_same_secret_only():
    auth = Authenticator(b"s" * 32)
    adv = _adv("127.0.0.1")
    echo = reach.listen(adv, auth)
    assert echo is not None and adv["port"] == echo.port
    try:
        assert reach.probe(adv, auth, 5.0) is None
        why = reach.probe(adv, Authenticator(b"t" * 32), 0.3)
        assert why is not None
    finally:
        echo.close()
    assert reach.probe(adv, auth, 0.3).startswith("no answer from tcp://127.0.0.1:")


def test_an_address_of_another_host_cannot_be_listened_on_and_says_so():
    adv = _adv("192.0.2.123")  # TEST-NET-1: never this host's in CI
    assert reach.listen(adv, Authenticator(b"s" * 32)) is None
    assert "not an address of this host" in adv["error"]
    line = reach.unreachable("decode", adv, reach.probe(adv, Authenticator(None), 0.1))
    assert line.startswith("the decode side would advertise 192.0.2.123 on lo to SGLang (step SGLANG_HOST_IP")
    assert line.endswith("set SGLANG_LOCAL_IP_NIC=eth1 (or SGLANG_HOST_IP=10.0.0.1) on the decode side")


def test_mooncake_probe_is_feature_detected():
    assert mooncake_probe(object(), "127.0.0.1", 1, 0.1) is None

    class Engine:
        def send_probe(self, session):
            return -102

    assert mooncake_probe(Engine(), "127.0.0.1", 15000, 1.0) == \
        "Mooncake send_probe to 127.0.0.1:15000 returned -102"
