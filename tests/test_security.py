"""Loopback by default, explicit opt-in for other hosts, HMAC on control and status messages,
and no code-executing decoder anywhere near network input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import zmq

from orchestrator import control
from orchestrator.auth import Authenticator, from_env
from orchestrator.config import ConfigError, validate
from orchestrator.plan import Platform, make_plan
from orchestrator.report import build_results
from orchestrator.runner import run_handoffs

from .conftest import DecodeProcess, compose_cfg

PKG = Path(__file__).resolve().parent.parent / "orchestrator"


def test_non_loopback_host_needs_explicit_opt_in():
    with pytest.raises(ConfigError, match="transport.allow_remote=true"):
        validate(compose_cfg("transport.host=10.1.2.3"))
    assert validate(compose_cfg("transport.host=10.1.2.3", "transport.allow_remote=true"))
    assert validate(compose_cfg("transport.host=127.0.0.2"))


def test_named_secret_must_exist(monkeypatch):
    monkeypatch.delenv("ORCH_NO_SUCH_SECRET", raising=False)
    with pytest.raises(ConfigError, match="transport.secret_env"):
        from_env("ORCH_NO_SUCH_SECRET")
    monkeypatch.setenv("ORCH_SECRET_T", "abc")
    assert from_env("ORCH_SECRET_T").enabled


def test_no_code_executing_decoders_in_the_package():
    pattern = re.compile(r"\b(import pickle|from pickle|pickle\.loads|marshal\.loads|yaml\.load\(|eval\(|exec\()")
    offenders = [str(p) for p in PKG.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.integration
def test_authenticated_run_verifies_everything(cfg_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_SECRET_RUN", "correct horse battery staple")
    cfg = cfg_factory("transport.secret_env=ORCH_SECRET_RUN", "workload.requests=100")
    plan = make_plan(cfg, Platform())
    res = build_results(100, plan, run_handoffs(cfg, plan, tmp_path))
    assert res["verified"] == 100 and res["rejected_auth"] == 0
    assert "correct horse" not in (tmp_path / "decode.log").read_text()


@pytest.mark.integration
def test_unauthenticated_control_is_rejected_and_counted(cfg_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_SECRET_REJ", "s3cret")
    decode = DecodeProcess(cfg_factory("transport.secret_env=ORCH_SECRET_REJ", "mem_pool=NVLINK"),
                           tmp_path)
    info = decode.info
    assert info["control_endpoint"].startswith("tcp://127.0.0.1:")
    assert info["data_endpoint"].startswith("tcp://127.0.0.1:")
    z = zmq.Context()
    dealer = z.socket(zmq.DEALER)
    dealer.connect(info["control_endpoint"])
    hello = control.encode("hello", item_lens=[64] * 10)
    dealer.send(hello)  # no MAC
    assert not dealer.poll(1000)
    dealer.send_multipart(Authenticator(b"wrong").sign([hello]))  # wrong secret
    assert not dealer.poll(1000)
    good = Authenticator(b"s3cret")
    dealer.send_multipart(good.sign([hello]))
    assert dealer.poll(10000)
    body = good.check(dealer.recv_multipart(), 1)
    assert body is not None  # the reply is signed too
    assert control.decode(body[0])["type"] in ("bootstrap", "error")
    stats = decode.stop()
    dealer.close(0)
    z.term()
    assert stats["rejected_auth"] == 2
