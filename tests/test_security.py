"""Loopback by default, explicit opt-in for other hosts, HMAC on control and status messages,
and no code-executing decoder anywhere near network input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import zmq

from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.profile.config import ConfigError, validate
from orchestrator.profile.kinds import run_secret, secret_from_env
from orchestrator.profile.plan import Platform

from .conftest import DecodeProcess, compose_cfg

PKG = Path(__file__).resolve().parent.parent / "orchestrator"


def test_non_loopback_host_needs_explicit_opt_in():
    with pytest.raises(ConfigError, match="transport.allow_remote=true"):
        validate(compose_cfg("transport.host=10.1.2.3"))
    assert validate(compose_cfg("transport.host=10.1.2.3", "transport.allow_remote=true"))
    assert validate(compose_cfg("transport.host=127.0.0.2"))


def test_named_secret_must_exist():
    with pytest.raises(ConfigError, match="transport.secret_env"):
        secret_from_env("ORCH_NO_SUCH_SECRET", {})
    assert secret_from_env("ORCH_SECRET_T", {"ORCH_SECRET_T": "abc"}) == b"abc"
    assert run_secret(None) != run_secret(None) and len(run_secret(None)) == 32


def test_no_code_executing_decoders_in_the_package():
    pattern = re.compile(r"\b(import pickle|from pickle|pickle\.loads|marshal\.loads|yaml\.load\(|eval\(|exec\()")
    offenders = [str(p) for p in PKG.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.integration
def test_authenticated_run_verifies_everything(run_job, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_SECRET_RUN", "correct horse battery staple")
    res = run_job(tmp_path, "transport.secret_env=ORCH_SECRET_RUN", "workload.requests=100",
                  platform=Platform(env={"ORCH_SECRET_RUN": "correct horse battery staple"}))
    assert res.verified == 100 and res.authenticated.rejected == 0
    assert not any("correct horse" in f.read_text(errors="replace") for f in tmp_path.glob("*.log"))


@pytest.mark.integration
def test_unauthenticated_control_is_rejected_and_counted(cfg_factory, tmp_path):
    decode = DecodeProcess(cfg_factory("mem_pool=NVLINK"), tmp_path, secret=b"s3cret")
    info = decode.info
    assert info.control_endpoint.startswith("tcp://127.0.0.1:")
    assert info.data_endpoint.startswith("tcp://127.0.0.1:")
    z = zmq.Context()
    dealer = z.socket(zmq.DEALER)
    dealer.connect(info.control_endpoint)
    hello = wire.encode("hello", rank=0, layout=[["x", "int32", 64]], fingerprint="", nonce="0" * 32)
    dealer.send(hello)  # no MAC
    assert not dealer.poll(1000)
    dealer.send(Authenticator(b"wrong").seal(hello))  # wrong secret
    assert not dealer.poll(1000)
    good = Authenticator(b"s3cret")
    dealer.send(good.seal(hello))
    assert dealer.poll(10000)
    body = good.unseal(dealer.recv())
    assert body is not None  # the reply is sealed too
    assert wire.decode(body).TYPE == "error"  # ... and refuses the made-up layout
    stats = decode.stop()
    dealer.close(0)
    z.term()
    assert stats.refused.rejected_auth == 2
