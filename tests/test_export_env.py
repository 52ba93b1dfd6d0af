"""serving_env (pure) for every profile that plans, and python -m orchestrator.export_env."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from orchestrator.preflight.export_env import render_json, render_sh
from orchestrator.preflight.serving import serving_env
from orchestrator.profile.config import ConfigError, MemPoolType, RouteSetting
from orchestrator.profile.plan import MANAGED_MC_VARS, Platform

from .conftest import ROOT, has_cuda, plan_of
from .test_doctor import clean_env, run_cli

GPU = Platform(cuda_devices=2, mooncake_cuda=True)
CPU = Platform()
PLATFORMS = {"2gpu": GPU, "cpu": CPU}
SGLANG_VARS = {"SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "SGLANG_MOONCAKE_SEND_AUX_TCP", "MOONCAKE_PROTOCOL"}


def refused(pool: MemPoolType, route: RouteSetting, platform: str) -> bool:
    """The combinations make_plan refuses (fallback=strict)."""
    if pool is MemPoolType.NVLINK and route is RouteSetting.engine:
        return True  # the NVLINK pool's aux always goes over tcp
    if pool is MemPoolType.INTRA_NODE_NVLINK:
        return platform == "cpu" or route is RouteSetting.tcp  # no CUDA / tcp cannot read GPU memory
    return False


@pytest.mark.parametrize("pool,route,platform",
                         list(itertools.product(MemPoolType, RouteSetting, PLATFORMS)))
def test_serving_env_every_combination(cfg_factory, pool, route, platform):
    cfg = cfg_factory(f"mem_pool={pool.value}", f"transport.route={route.value}")
    if refused(pool, route, platform):
        with pytest.raises(ConfigError):
            plan_of(cfg, PLATFORMS[platform])
        return
    plan = plan_of(cfg, PLATFORMS[platform])
    env = serving_env(plan)
    tcp_route = pool is MemPoolType.NVLINK or route is RouteSetting.tcp
    nvlink = pool is MemPoolType.INTRA_NODE_NVLINK

    assert env["SGLANG_MOONCAKE_CUSTOM_MEM_POOL"] == (None if pool is MemPoolType.NONE else pool.value)
    forced = route is RouteSetting.tcp and pool is not MemPoolType.NVLINK
    assert env["SGLANG_MOONCAKE_SEND_AUX_TCP"] == ("1" if forced else None)
    assert env["MOONCAKE_PROTOCOL"] == ("nvlink_intra" if nvlink else "tcp")
    if tcp_route:  # no engine for aux: no MC_* variable is named
        assert set(env) == SGLANG_VARS
    else:
        assert set(env) == SGLANG_VARS | set(MANAGED_MC_VARS)
        assert env["MC_INTRANODE_NVLINK"] == ("1" if nvlink else None)
        assert env["MC_FORCE_TCP"] == (None if nvlink else "1")
        assert env["MC_FORCE_MNNVL"] is None and env["MC_FORCE_HCA"] is None
        assert env["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "5"
    assert all(v is None or isinstance(v, str) for v in env.values())


def test_serving_env_table(cfg_factory):
    """The four profiles people deploy, spelled out."""
    nvl = serving_env(plan_of(cfg_factory("mem_pool=INTRA_NODE_NVLINK"), GPU))
    assert {k: v for k, v in nvl.items() if v is not None} == {
        "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK", "MOONCAKE_PROTOCOL": "nvlink_intra",
        "MC_INTRANODE_NVLINK": "1", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5"}
    default = serving_env(plan_of(cfg_factory(), CPU))
    assert {k: v for k, v in default.items() if v is not None} == {
        "MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5"}
    assert serving_env(plan_of(cfg_factory("mem_pool=NVLINK"), CPU)) == {
        "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "NVLINK", "SGLANG_MOONCAKE_SEND_AUX_TCP": None,
        "MOONCAKE_PROTOCOL": "tcp"}
    assert serving_env(plan_of(cfg_factory("transport.route=tcp"), CPU)) == {
        "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": None, "SGLANG_MOONCAKE_SEND_AUX_TCP": "1",
        "MOONCAKE_PROTOCOL": "tcp"}


def test_serving_env_rdma_transport(cfg_factory):
    env = serving_env(plan_of(cfg_factory("transport.mooncake.transport=rdma"), CPU))
    assert env["MOONCAKE_PROTOCOL"] == "rdma"
    assert all(env[name] is None for name in ("MC_FORCE_TCP", "MC_INTRANODE_NVLINK"))


def test_serving_env_degraded_nvlink_names_no_pool(cfg_factory):
    """A degraded plan runs host buffers over TCP; SGLang has no fallback, so naming the pool
    would put its buffers on CUDA: the pool is unset instead."""
    plan = plan_of(cfg_factory("mem_pool=INTRA_NODE_NVLINK", "transport.fallback=degrade"), CPU)
    env = serving_env(plan)
    assert env["SGLANG_MOONCAKE_CUSTOM_MEM_POOL"] is None
    assert env["MC_FORCE_TCP"] == "1" and env["MC_INTRANODE_NVLINK"] is None
    assert env["MOONCAKE_PROTOCOL"] == "tcp"


def test_render_sh_sorted_and_quoted():
    env = {"B_VAR": "x y'z", "A_VAR": "1", "Z_GONE": None, "C_GONE": None}
    lines = render_sh(env, "profile\nwith a newline").splitlines()
    assert lines[0] == "# profile with a newline"
    assert lines[1:] == ["export A_VAR=1", "export B_VAR=" + shlex.quote("x y'z"),
                         "unset C_GONE", "unset Z_GONE"]
    assert shlex.split(lines[2])[1] == "B_VAR=x y'z"
    assert json.loads(render_json(env)) == {"set": {"A_VAR": "1", "B_VAR": "x y'z"},
                                            "unset": ["C_GONE", "Z_GONE"]}


# --- the CLI --------------------------------------------------------------------------------------

def test_cli_default():
    proc = run_cli("orchestrator.export_env")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# ") and "(defaults)" in lines[0]
    assert "export MC_FORCE_TCP=1" in lines and "unset MC_INTRANODE_NVLINK" in lines
    body = lines[1:]
    exports = [ln for ln in body if ln.startswith("export ")]
    unsets = [ln for ln in body if ln.startswith("unset ")]
    assert body == exports + unsets and exports == sorted(exports) and unsets == sorted(unsets)


def test_cli_assume_gpus():
    proc = run_cli("orchestrator.export_env", "mem_pool=INTRA_NODE_NVLINK", "--assume-gpus", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "mem_pool=INTRA_NODE_NVLINK" in lines[0]
    for expected in ("export MC_INTRANODE_NVLINK=1",
                     "export SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK",
                     "export MOONCAKE_PROTOCOL=nvlink_intra", "unset MC_FORCE_TCP"):
        assert expected in lines, proc.stdout


def test_cli_json():
    proc = run_cli("orchestrator.export_env", "mem_pool=NVLINK", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "set": {"MOONCAKE_PROTOCOL": "tcp", "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "NVLINK"},
        "unset": ["SGLANG_MOONCAKE_SEND_AUX_TCP"]}


@pytest.mark.parametrize("args,needle", [
    (["mem_pool=FOO"], "mem_pool/FOO"),
    (["buffers.size=0"], "buffers.size=0"),
    (["mem_pool=NVLINK", "transport.route=engine"], "transport.route='engine'"),
])
def test_cli_refuses_bad_profiles(args, needle):
    proc = run_cli("orchestrator.export_env", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_refuses_gpu_profile_on_cpu_box_and_points_to_assume_gpus():
    if has_cuda():
        pytest.skip("CPU-only expectation")
    proc = run_cli("orchestrator.export_env", "mem_pool=INTRA_NODE_NVLINK")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "INTRA_NODE_NVLINK" in lines[0] and "--assume-gpus" in lines[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_cli_output_evals_in_bash():
    env = clean_env() | {"MC_FORCE_TCP": "1", "SGLANG_MOONCAKE_SEND_AUX_TCP": "1"}
    script = ('eval "$(python -m orchestrator.export_env mem_pool=INTRA_NODE_NVLINK --assume-gpus 2)"'
              ' && env')
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert got["MC_INTRANODE_NVLINK"] == "1" and got["MOONCAKE_PROTOCOL"] == "nvlink_intra"
    assert "MC_FORCE_TCP" not in got and "SGLANG_MOONCAKE_SEND_AUX_TCP" not in got
