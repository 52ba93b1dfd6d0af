"""The wrong-address trap on two multi-homed "hosts" (network namespaces, tests/helpers/netns.py
MultiHomedPair): each has a management interface that carries the default route and a data
interface (the veth, 192.0.2.0/24), and the peer is reachable through the data interface only.

- SGLang 0.5.23's own get_local_ip_auto (compiled from the installed release, with netifaces)
  and this tool's rule give the same address inside a namespace, under each variable;
- `python -m orchestrator.doctor --peer-address` FAILs the default route's choice, naming the
  interface and SGLANG_LOCAL_IP_NIC, and passes once SGLANG_LOCAL_IP_NIC names the data NIC.

Needs root and `ip netns` (skips otherwise). Runs on the netns module's worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT
from .helpers.netns import DECODE_IP, MGMT_DEV, PREFILL_IP, MultiHomedPair, NetnsUnavailable

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("netns")]

# run inside a namespace: SGLang's rule and ours, under the environment given on stdin
_COMPARE = """
import json, os, sys
sys.path.insert(0, os.getcwd())
from tests.helpers import sglang_oracle
from orchestrator.profile.address import advertise, probe_host
rule = sglang_oracle.local_ip_rule()
out = []
for env in json.load(sys.stdin):
    for var in ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC"):
        os.environ.pop(var, None)
    os.environ.update(env)
    adv = advertise(probe_host(env))
    out.append([rule(), adv.address, adv.step.value])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hosts():
    try:
        p = MultiHomedPair.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    try:
        yield p
    finally:
        assert not p.destroy()


def _in(hosts, ns: str, argv: list[str], env: dict, stdin: str = "", timeout: float = 120):
    child = {k: v for k, v in os.environ.items() if k not in ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC")}
    return subprocess.run(hosts.exec_args(ns, argv), cwd=ROOT, env={**child, **env}, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_sglang_rule_is_the_oracle_on_a_multi_homed_host(hosts):
    pytest.importorskip("netifaces")
    cases = [{}, {"SGLANG_LOCAL_IP_NIC": hosts.prefill_dev}, {"SGLANG_LOCAL_IP_NIC": MGMT_DEV},
             {"SGLANG_LOCAL_IP_NIC": "nosuch0"}, {"HOST_IP": PREFILL_IP}]
    proc = _in(hosts, hosts.prefill_ns, [sys.executable, "-c", _COMPARE], {}, json.dumps(cases))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    mgmt = hosts.mgmt_ip("prefill")
    assert got == [[mgmt, mgmt, "default route"], [PREFILL_IP, PREFILL_IP, "SGLANG_LOCAL_IP_NIC"],
                   [mgmt, mgmt, "SGLANG_LOCAL_IP_NIC"], [mgmt, mgmt, "default route"],
                   [PREFILL_IP, PREFILL_IP, "HOST_IP"]]


def _address_line(stdout: str) -> str:
    return next(ln for ln in stdout.splitlines() if ln.split()[1:2] == ["address"])


def test_doctor_fails_the_default_route_choice_then_the_nic_fixes_it(hosts):
    argv = [sys.executable, "-m", "orchestrator.doctor", "--peer-address", DECODE_IP]
    bad = _in(hosts, hosts.prefill_ns, argv, {})
    line = _address_line(bad.stdout)
    assert bad.returncode == 1 and line.startswith("FAIL"), bad.stdout + bad.stderr
    assert f"would advertise {hosts.mgmt_ip('prefill')} on {MGMT_DEV} (step default route" in line
    assert f"set SGLANG_LOCAL_IP_NIC={hosts.prefill_dev} (or SGLANG_HOST_IP={PREFILL_IP})" in line
    good = _in(hosts, hosts.prefill_ns, argv, {"SGLANG_LOCAL_IP_NIC": hosts.prefill_dev})
    line = _address_line(good.stdout)
    assert good.returncode == 0 and line.startswith("OK"), good.stdout + good.stderr
    assert f"would advertise {PREFILL_IP} on {hosts.prefill_dev} (step SGLANG_LOCAL_IP_NIC" in line
    print("\n[address] " + _address_line(bad.stdout) + "\n[address] " + line)
