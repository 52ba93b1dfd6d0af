"""python -m orchestrator.doctor: each check's statuses from fabricated inputs, and the CLI."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest

from orchestrator.job.check import doctor_spec
from orchestrator.preflight import compose as profile
from orchestrator.preflight import doctor
from orchestrator.preflight.compose import one_line
from orchestrator.preflight.doctor import (
    Check,
    CudaProbe,
    MooncakeProbe,
    check_alloc_conf,
    check_cuda,
    check_host,
    check_mc_env,
    check_mooncake,
    check_plan,
    check_rpc_ports,
    intended_plan,
    intra_nvlink_built,
    port_is_free,
    rpc_port_range,
)
from orchestrator.preflight.doctor import (
    CheckStatus as Status,
)
from orchestrator.profile.config import ConfigError
from orchestrator.profile.plan import ALLOC_CONF_VARS, Device, EngineTransport, Platform, Route

from .conftest import ROOT, has_cuda, plan_of

CPU = Platform()
TWO_GPU = Platform(cuda_devices=2, mooncake_cuda=True)


def clean_env() -> dict[str, str]:
    """The test process's environment without anything the checks judge."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MC_") and k not in ALLOC_CONF_VARS}


def run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


# --- profile loading ----------------------------------------------------------------------------

def test_one_line_flattens_hydra_messages():
    exc = RuntimeError("In 'config': Could not find 'mem_pool/FOO'\n\nAvailable options in 'mem_pool':"
                       "\n\tBAREX\n\tNONE\nConfig search path:\n\tprovider=hydra, path=pkg://hydra.conf")
    assert one_line(exc) == ("In 'config': Could not find 'mem_pool/FOO'; "
                             "Available options in 'mem_pool': BAREX, NONE")
    wrapped = RuntimeError("Error merging override transport.route=bogus")
    wrapped.__cause__ = ValueError("Invalid value 'bogus', expected one of [auto, tcp, engine]\n"
                                   "    full_key: transport.route")
    assert one_line(wrapped) == ("Error merging override transport.route=bogus: Invalid value 'bogus', "
                                 "expected one of [auto, tcp, engine]")


@pytest.mark.parametrize("override,needle", [
    ("mem_pool=FOO", "mem_pool/FOO"), ("buffers.size=0", "buffers.size=0"),
    ("transport.route=bogus", "transport.route=bogus"), ("buffers.sise=3", "sise"),
    ("mem_pool", "mem_pool"),
])
def test_load_profile_errors_are_one_line(override, needle):
    with pytest.raises(profile.ProfileError) as info:
        profile.load_profile([override])
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_overrides_dict():
    assert profile.overrides_dict(["mem_pool=NVLINK", "+x.y=a=b", "bare"]) == {
        "mem_pool": "NVLINK", "+x.y": "a=b", "bare": None}


# --- what the profile declares --------------------------------------------------------------------

def intent_of(cfg, platform):
    """intended_plan over the sections of a whole config it reads."""
    return intended_plan(cfg.mem_pool, cfg.transport, cfg.endpoints, cfg.role, platform)


def test_intended_plan_of_a_refused_profile_names_its_needs(cfg_factory):
    """The same rules, on a machine that has what the profile asks for (no re-derivation)."""
    cfg = cfg_factory("mem_pool=INTRA_NODE_NVLINK")
    with pytest.raises(ConfigError):
        plan_of(cfg, CPU)
    intent = intent_of(cfg, CPU)
    assert intent.buffer_device is Device.cuda and intent.engine_transport is EngineTransport.nvlink_intra
    assert intent.route is Route.engine and (intent.prefill_gpus, intent.decode_gpus) == ((0,), (1,))
    four = intent_of(cfg_factory("experiment=pd_8gpu_nvlink"), CPU)
    assert four.prefill_gpus == (0, 1, 2, 3) and four.decode_gpus == (4, 5, 6, 7)
    assert intent_of(cfg_factory("mem_pool=NVLINK", "transport.route=engine"), CPU) is None


# --- 1. mooncake ----------------------------------------------------------------------------------

def test_intra_nvlink_marker_in_fabricated_libraries(tmp_path):
    without = tmp_path / "engine.so"
    without.write_bytes(b"\x7fELF...Protocol 'nvlink_intra' requires -DUSE_INTRA_NVLINK=ON\x00...")
    with_flag = tmp_path / "engine.cpython-312-x86_64-linux-gnu.so"
    with_flag.write_bytes(b"\x7fELF...Using Intra-Node NVLink transport (MC_INTRANODE_NVLINK set)\x00")
    assert intra_nvlink_built([without]) == (str(without), False)
    assert intra_nvlink_built([with_flag]) == (str(with_flag), True)
    assert intra_nvlink_built([tmp_path / "missing.so"]) == (None, None)
    assert intra_nvlink_built([]) == (None, None)


def test_installed_wheel_probe():
    """On the CPU wheel the marker is present (verified against mooncake-transfer-engine-non-cuda
    0.3.13.post1; the cuda13 0.3.14 wheel's engine.so lacks it)."""
    probe = doctor.probe_mooncake()
    if probe.distribution is None:
        pytest.skip("no Mooncake wheel installed")
    assert probe.engine_so is not None
    if probe.distribution[0].endswith("-non-cuda"):
        assert probe.cuda_build is False and probe.intra_nvlink_built is False
    if probe.distribution[0].endswith("-cuda13"):
        assert probe.cuda_build is True and probe.intra_nvlink_built is True


CPU_WHEEL = MooncakeProbe(("mooncake-transfer-engine-non-cuda", "0.3.13.post1"), None, False,
                          "/x/mooncake/engine.so", False)
CUDA_WHEEL = MooncakeProbe(("mooncake-transfer-engine-cuda13", "0.3.14"), None, True,
                           "/x/mooncake/engine.so", True)


def test_mooncake_cpu_wheel_tcp_plan_ok():
    check = check_mooncake(CPU_WHEEL, uses_engine=True, wants_nvlink=False)
    assert check.status is Status.OK
    assert "0.3.13.post1" in check.detail and "requires -DUSE_INTRA_NVLINK" in check.detail


def test_mooncake_cpu_wheel_nvlink_plan_fails():
    check = check_mooncake(CPU_WHEEL, uses_engine=True, wants_nvlink=True)
    assert check.status is Status.FAIL and "cuda13" in check.detail


def test_mooncake_cuda_wheel_without_nvlink_flag_fails():
    probe = MooncakeProbe(CUDA_WHEEL.distribution, None, True, "/x/engine.so", False)
    assert check_mooncake(probe, True, True).status is Status.FAIL
    assert check_mooncake(CUDA_WHEEL, True, True).status is Status.OK


def test_mooncake_unreadable_library_warns_for_nvlink():
    probe = MooncakeProbe(CUDA_WHEEL.distribution, None, True, None, None)
    assert check_mooncake(probe, True, True).status is Status.WARN
    assert check_mooncake(probe, True, False).status is Status.OK


def test_mooncake_import_failure_names_libibverbs():
    probe = MooncakeProbe(CPU_WHEEL.distribution,
                          "ImportError: libibverbs.so.1: cannot open shared object file", False, None, None)
    check = check_mooncake(probe, uses_engine=True, wants_nvlink=False)
    assert check.status is Status.FAIL and "apt-get install -y libibverbs1" in check.detail
    # the tcp route starts no engine: a broken wheel is advice, not a failure
    assert check_mooncake(probe, uses_engine=False, wants_nvlink=False).status is Status.WARN


def test_mooncake_not_installed():
    probe = MooncakeProbe(None, "ModuleNotFoundError: No module named 'mooncake'", False, None, None)
    assert check_mooncake(probe, True, False).status is Status.FAIL
    assert check_mooncake(probe, False, False).status is Status.WARN


# --- 2. plan --------------------------------------------------------------------------------------

def test_plan_ok(cfg_factory):
    check = check_plan(plan_of(cfg_factory(), CPU), None)
    assert check.status is Status.OK
    assert "route engine" in check.detail and "mooncake-tcp" in check.detail and "cpu" in check.detail


def test_plan_degraded_warns(cfg_factory):
    plan = plan_of(cfg_factory("mem_pool=INTRA_NODE_NVLINK", "transport.fallback=degrade"), CPU)
    check = check_plan(plan, None)
    assert check.status is Status.WARN and "degraded_no_cuda" in check.detail


def test_plan_error_fails(cfg_factory):
    with pytest.raises(ConfigError) as info:
        plan_of(cfg_factory("mem_pool=INTRA_NODE_NVLINK"), CPU)
    check = check_plan(None, info.value)
    assert check.status is Status.FAIL and "mem_pool='INTRA_NODE_NVLINK'" in check.detail


# --- 3. cuda --------------------------------------------------------------------------------------

def test_cuda_not_needed_on_host_buffers():
    check = check_cuda(Device.cpu, None, None, None)
    assert check.status is Status.OK and "Not needed" in check.detail


@pytest.mark.parametrize("probe,prefill,decode,status", [
    (CudaProbe(), 0, 1, Status.FAIL),  # no CUDA
    (CudaProbe(error="RuntimeError: driver too old"), 0, 1, Status.FAIL),
    (CudaProbe(2, ("H200", "H200"), True), 0, 1, Status.OK),
    (CudaProbe(2, ("H200", "H200"), False), 0, 1, Status.WARN),  # no peer access
    (CudaProbe(1, ("H200",)), 0, 0, Status.OK),  # one GPU, both endpoints on it
    (CudaProbe(1, ("H200",)), 0, 1, Status.FAIL),  # decode GPU does not exist
])
def test_cuda_statuses(probe, prefill, decode, status):
    check = check_cuda(Device.cuda, prefill, decode, probe)
    assert check.status is status, check.detail


def test_cuda_detail_names_devices():
    check = check_cuda(Device.cuda, 0, 1, CudaProbe(2, ("NVIDIA H200", "NVIDIA H200"), True))
    assert "0: NVIDIA H200" in check.detail and "can access GPU 1" in check.detail


# --- 4. MC_* presence traps -----------------------------------------------------------------------

NVLINK_ENV = {"MC_INTRANODE_NVLINK": "1", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5", "MC_FORCE_TCP": None}
TCP_ENV = {"MC_FORCE_TCP": "1", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5", "MC_INTRANODE_NVLINK": None}


def test_mc_env_clean_shell_ok():
    check = check_mc_env({"PATH": "/bin"}, wants_nvlink=False, plan_env=TCP_ENV)
    assert check.status is Status.OK and "MC_FORCE_TCP" in check.detail  # differs, but our runs set it
    assert check_mc_env({}, False, {}).status is Status.OK


@pytest.mark.parametrize("value", ["0", "false", "no", "False", "NO", "n", "off", ""])
def test_mc_env_off_looking_values_warn(value):
    check = check_mc_env({"MC_INTRANODE_NVLINK": value}, wants_nvlink=False, plan_env=TCP_ENV)
    assert check.status is Status.WARN and "presence" in check.detail


def test_mc_env_nvlink_unset_warns():
    check = check_mc_env({}, wants_nvlink=True, plan_env=NVLINK_ENV)
    assert check.status is Status.WARN
    assert "TCP" in check.detail and "orchestrator.export_env" in check.detail
    assert check_mc_env({"MC_INTRANODE_NVLINK": "1"}, True, NVLINK_ENV).status is Status.OK


def test_mc_env_force_tcp_with_nvlink_warns():
    check = check_mc_env({"MC_INTRANODE_NVLINK": "1", "MC_FORCE_TCP": "1"}, True, NVLINK_ENV)
    assert check.status is Status.WARN and "MC_FORCE_TCP" in check.detail
    # the same shell is fine for a tcp plan
    assert check_mc_env({"MC_FORCE_TCP": "1"}, False, TCP_ENV).status is Status.OK


# --- 5. expandable segments -----------------------------------------------------------------------

@pytest.mark.parametrize("env,wants_nvlink,status", [
    ({}, True, Status.OK),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True, Status.FAIL),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}, True, Status.FAIL),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, True, Status.OK),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False, Status.OK),
])
def test_alloc_conf(env, wants_nvlink, status):
    check = check_alloc_conf(env, wants_nvlink)
    assert check.status is status
    if status is Status.FAIL:
        assert "cuMemCreate" in check.detail


# --- 6. RPC ports ---------------------------------------------------------------------------------

def test_rpc_port_range_parsing():
    assert rpc_port_range({}) == (15000, 17000)
    assert rpc_port_range({"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": " 20500 "}) == (20000, 20500)
    with pytest.raises(ValueError, match="MC_MIN_RPC_PORT"):
        rpc_port_range({"MC_MIN_RPC_PORT": "15k"})
    with pytest.raises(ValueError, match="MC_MAX_RPC_PORT"):
        rpc_port_range({"MC_MAX_RPC_PORT": "70000"})


def test_rpc_ports_probes_a_sample_plus_the_ends():
    probed: list[int] = []

    def free(host, port):
        probed.append(port)
        return True

    check = check_rpc_ports({}, "127.0.0.1", is_free=free, rng=random.Random(1))
    assert check.status is Status.OK
    assert len(probed) == 66 and 15000 in probed and 17000 in probed
    assert all(15000 <= p <= 17000 for p in probed)
    assert "66 of 66" in check.detail


def test_rpc_ports_none_free_fails():
    check = check_rpc_ports({}, "127.0.0.1", is_free=lambda h, p: False)
    assert check.status is Status.FAIL and "segfault" in check.detail
    # a tcp-route plan starts no engine: capped at WARN
    assert check_rpc_ports({}, "127.0.0.1", is_free=lambda h, p: False,
                           uses_engine=False).status is Status.WARN


def test_rpc_ports_some_free_ok():
    check = check_rpc_ports({}, "127.0.0.1", is_free=lambda h, p: p % 2 == 0, rng=random.Random(2))
    assert check.status is Status.OK


@pytest.mark.parametrize("env,status", [
    ({"MC_MIN_RPC_PORT": "16000", "MC_MAX_RPC_PORT": "15000"}, Status.FAIL),  # inverted
    ({"MC_MIN_RPC_PORT": "abc"}, Status.FAIL),
    ({"MC_MIN_RPC_PORT": "16000", "MC_MAX_RPC_PORT": "16049"}, Status.WARN),  # 50 ports
    ({"MC_MIN_RPC_PORT": "16000", "MC_MAX_RPC_PORT": "16099"}, Status.OK),  # 100 ports
])
def test_rpc_ports_range_from_env(env, status):
    probed: list[int] = []
    check = check_rpc_ports(env, "127.0.0.1", is_free=lambda h, p: probed.append(p) or True)
    assert check.status is status, check.detail
    if status is Status.WARN:
        assert sorted(probed) == list(range(16000, 16050))  # a small range is probed whole


def test_port_is_free_sees_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert port_is_free("127.0.0.1", port) is False
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert port_is_free("127.0.0.1", port) is True


# --- 7. host --------------------------------------------------------------------------------------

def test_host_loopback_ok():
    check = check_host("127.0.0.1", try_bind=lambda h: pytest.fail("loopback needs no bind"))
    assert check.status is Status.OK and "loopback only" in check.detail
    assert check_host("127.0.0.2", try_bind=lambda h: None).status is Status.OK


def test_host_not_local_fails():
    check = check_host("10.9.9.9", try_bind=lambda h: "Cannot assign requested address")
    assert check.status is Status.FAIL and "not an address of this machine" in check.detail


def test_host_local_non_loopback_warns():
    check = check_host("192.0.2.2", try_bind=lambda h: None)
    assert check.status is Status.WARN and "reachable from the network" in check.detail
    assert check_host("0.0.0.0", try_bind=lambda h: None).status is Status.WARN


def test_a_missing_secret_is_the_rule_books_refusal(cfg_factory):
    report = doctor.run_checks(doctor_spec(cfg_factory("transport.secret_env=PD_AUX_SECRET")), [], env={})
    plan = next(c for c in report.checks if c.name == "plan")
    assert plan.status is Status.FAIL and "transport.secret_env" in plan.detail and not report.ok


def test_bind_error_for_real():
    assert doctor.bind_error("127.0.0.1") is None
    assert doctor.bind_error("203.0.113.77") is not None  # TEST-NET-3: no machine's address


# --- report ---------------------------------------------------------------------------------------

def test_report_ok_and_json():
    checks = [Check("a", Status.OK, "fine."), Check("b", Status.WARN, "hm.")]
    report = doctor.Report(["mem_pool=NONE"], checks)
    assert report.ok
    data = report.as_dict()
    assert data["profile"] == {"mem_pool": "NONE"} and data["ok"] is True
    assert data["checks"][1] == {"name": "b", "status": "WARN", "detail": "hm."}
    failed = doctor.Report([], checks + [Check("c", Status.FAIL, "no.")])
    assert not failed.ok and "1 FAIL: c" in failed.text()


# --- the CLI --------------------------------------------------------------------------------------

CHECK_NAMES = ["mooncake", "plan", "cuda", "mc-env", "alloc-conf", "rpc-ports", "host", "address", "versions"]


def test_cli_default_profile_runs_here():
    proc = run_cli("orchestrator.doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln.split()[1] for ln in lines[:9]] == CHECK_NAMES
    assert all(ln.split()[0] in {"OK", "WARN"} for ln in lines[:9])
    assert "can run as declared" in lines[-1]


@pytest.mark.skipif(has_cuda(), reason="CPU-only expectation")
def test_cli_intra_node_nvlink_fails_on_cpu_box():
    proc = run_cli("orchestrator.doctor", "mem_pool=INTRA_NODE_NVLINK")
    assert proc.returncode != 0
    fails = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails and any(" plan " in ln for ln in fails)
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("override", ["mem_pool=FOO", "buffers.size=0"])
def test_cli_bad_profile_is_one_error_line(override):
    proc = run_cli("orchestrator.doctor", override)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert override.split("=")[1] in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_json():
    proc = run_cli("orchestrator.doctor", "mem_pool=NVLINK", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["profile"] == {"mem_pool": "NVLINK"} and data["ok"] is True
    assert [c["name"] for c in data["checks"]] == CHECK_NAMES
    assert all(set(c) == {"name", "status", "detail"} for c in data["checks"])
    assert data["plan"]["route"] == "tcp"


def test_doctor_compares_the_peer_profile_layout():
    """--peer: a prefill and a decode profile whose aux layouts differ FAIL, naming the first
    differing field; equal layouts pass."""
    proc = run_cli("orchestrator.doctor", "buffers.enable_sampling_mask=true",
                   "--peer", "layout=sglang_pre_0_5_23")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.split()[1:2] == ["layout"])
    assert line.startswith("FAIL") and "field 6" in line and "output_token_sampling_mask_len" in line
    proc = run_cli("orchestrator.doctor", "--peer", "transport.route=tcp")
    assert proc.returncode == 0 and "give the same 10 fields" in proc.stdout
