"""The wrong-address trap on two multi-homed "hosts" (network namespaces, tests/helpers/netns.py
MultiHomedPair): each has a management interface that carries the default route and a data
interface (the veth, 192.0.2.0/24), and the peer is reachable through the data interface only.

- SGLang 0.5.23's own get_local_ip_auto (compiled from the installed release, with netifaces)
  and this tool's rule give the same address inside a namespace, under each variable;
- `python -m orchestrator.doctor --peer-address` FAILs the default route's choice, naming the
  interface and SGLANG_LOCAL_IP_NIC, and passes once SGLANG_LOCAL_IP_NIC names the data NIC;
- a split run (role=decode / role=prefill, transport.address_check=fail): each side's probe of
  the address the other would advertise fails before any handoff, naming the interface, the
  step and the variable; SGLANG_LOCAL_IP_NIC on both sides fixes it (every handoff verified);
  a version skew is a warning, a known Mooncake incompatibility refuses the run.

Needs root and `ip netns` (skips otherwise). Runs on the netns module's worker.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.profile import versions
from orchestrator.results.schema import Results

from .conftest import ROOT
from .helpers.netns import DECODE_IP, MGMT_DEV, PREFILL_IP, MultiHomedPair, NetnsUnavailable
from .test_netns import (
    SECRET,
    SECRET_ENV,
    Side,
    _overrides,
    decode_overrides,
    prefill_overrides,
    verified_rids,
)

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


# ---- a split run between the two hosts: the bootstrap's peer checks ----------------------------
_split_ports = itertools.count(17400)
ADDRESS_VARS = ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC", versions.TEST_HOOK_VAR)


def _side(hosts, ns: str, name: str, base: Path, overrides: dict, env: dict) -> Side:
    run_dir = base / name
    child = {k: v for k, v in os.environ.items() if k not in ADDRESS_VARS}
    child.update({SECRET_ENV: SECRET, "PYTHONUNBUFFERED": "1", **env})
    out, err = base / f"{name}.stdout", base / f"{name}.stderr"
    argv = [sys.executable, "-m", "orchestrator", *_overrides(overrides), f"hydra.run.dir={run_dir}"]
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(hosts.exec_args(ns, argv), cwd=ROOT, env=child, stdout=fo, stderr=fe,
                                stdin=subprocess.DEVNULL)
    return Side(name, proc, run_dir, out, err)


def _split(hosts, base: Path, name: str, decode_env: dict, prefill_env: dict, requests: int = 40):
    port = next(_split_ports)
    # start-up has taken over 20 s on a loaded 2-core box: a slow start is not what these test
    check = {"transport.address_check": "fail", "endpoints.startup_timeout_s": 90}
    d = _side(hosts, hosts.decode_ns, f"{name}-decode", base, decode_overrides(port, "engine", **check), decode_env)
    p = _side(hosts, hosts.prefill_ns, f"{name}-prefill", base,
              prefill_overrides(port, "engine", requests, **check), prefill_env)
    try:
        for s in (p, d):
            s.proc.wait(240)
    finally:
        for s in (p, d):
            s.kill()
    return p, d


@pytest.fixture
def clean(hosts):
    yield hosts
    for ns in (hosts.prefill_ns, hosts.decode_ns):
        hosts.kill_all(ns)


@pytest.mark.slow
def test_split_run_refuses_an_unreachable_advertised_address_then_the_nic_fixes_it(clean, tmp_path):
    """Each side advertises its default route's address (the management network): the peer's
    probe fails before any handoff, naming the interface, the step and SGLANG_LOCAL_IP_NIC.
    With SGLANG_LOCAL_IP_NIC naming each side's data link, every handoff is verified; a torch
    skew (the test hook) is a warning in results.json."""
    hosts = clean
    p, d = _split(hosts, tmp_path, "bad", {}, {})
    text = p.stdout + p.stderr
    assert p.proc.returncode not in (0, None), p.tail()
    line = next((ln for ln in text.splitlines() if "refused" in ln and "would advertise" in ln), "")
    assert "on mgmt0 to SGLang (step default route of SGLang 0.5.23's get_local_ip_auto)" in line, p.tail()
    assert "which its peer cannot reach: no answer from tcp://" in line and "set SGLANG_LOCAL_IP_NIC=pd" in line
    assert not verified_rids(p.run_dir) and d.proc.returncode not in (0, None), d.tail()
    print("\n[split] " + line)
    p, d = _split(hosts, tmp_path, "fixed", {"SGLANG_LOCAL_IP_NIC": hosts.decode_dev},
                  {"SGLANG_LOCAL_IP_NIC": hosts.prefill_dev, versions.TEST_HOOK_VAR: "torch=2.9.0"})
    assert p.proc.returncode == 0 and d.proc.returncode == 0, p.tail() + d.tail()
    res = Results.read(p.run_dir)
    assert res.verified == 40
    skew = [w for w in res.ending.warnings if w.startswith("versions: torch 2.9.0 here")]
    assert skew, res.ending.warnings
    assert [w for w in Results.read(d.run_dir).ending.warnings if "on the peer" in w and "torch" in w]
    assert not [w for w in res.ending.warnings if "cannot reach" in w]


@pytest.mark.slow
def test_split_run_refuses_a_known_mooncake_incompatibility(clean, tmp_path):
    """The decode side reports Mooncake 0.3.10 (the test hook): across 0.3.11 the run is refused
    at bootstrap, citing the incompatibility."""
    hosts = clean
    p, d = _split(hosts, tmp_path, "skew", {"SGLANG_LOCAL_IP_NIC": hosts.decode_dev,
                                            versions.TEST_HOOK_VAR: "mooncake=0.3.10"},
                  {"SGLANG_LOCAL_IP_NIC": hosts.prefill_dev})
    text = p.stdout + p.stderr
    assert p.proc.returncode not in (0, None) and "refused" in text, p.tail()
    assert "Failed to get segment descriptor" in text and "SGLang #26008, Mooncake #2177" in text
    assert not verified_rids(p.run_dir)
