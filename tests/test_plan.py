"""The pure rules: device, route, engine environment, and what make_plan refuses."""

from __future__ import annotations

import itertools

import pytest

from orchestrator.profile.config import ConfigError, FallbackPolicy, MemPoolType, RouteSetting
from orchestrator.profile.plan import (
    MANAGED_MC_VARS,
    Device,
    EngineTransport,
    Platform,
    Reason,
    Route,
    buffer_device,
    engine_env,
    gpu_placement,
    route_rule,
)

from .conftest import plan_of

CPU = Platform(cuda_devices=0, mooncake_cuda=False)
ONE_GPU = Platform(cuda_devices=1, mooncake_cuda=True)
TWO_GPU = Platform(cuda_devices=2, mooncake_cuda=True)
GPU_NO_MC_CUDA = Platform(cuda_devices=2, mooncake_cuda=False)
NPU = Platform(npu=True)
PLATFORMS = {"cpu": CPU, "1gpu": ONE_GPU, "2gpu": TWO_GPU, "gpu-noncuda-mooncake": GPU_NO_MC_CUDA,
             "npu": NPU}

EXPECTED_DEVICE = {
    MemPoolType.NONE: Device.cpu,
    MemPoolType.NVLINK: Device.cpu,
    MemPoolType.BAREX: Device.cpu,
    MemPoolType.INTRA_NODE_NVLINK: Device.cuda,
}


@pytest.mark.parametrize("pool,platform", list(itertools.product(MemPoolType, PLATFORMS)))
def test_device_rule(pool, platform):
    got = buffer_device(pool, PLATFORMS[platform])
    assert got is (Device.npu if platform == "npu" else EXPECTED_DEVICE[pool])


@pytest.mark.parametrize("pool,setting", list(itertools.product(MemPoolType, RouteSetting)))
def test_route_rule(pool, setting):
    route, reason = route_rule(pool, setting)
    if pool is MemPoolType.NVLINK:
        assert (route, reason) == (Route.tcp, Reason.pool_nvlink_sends_over_tcp)
    elif setting is RouteSetting.tcp:
        assert (route, reason) == (Route.tcp, Reason.route_forced_tcp)
    else:
        assert route is Route.engine


def test_no_pool_name_matches_by_substring():
    """Regression for `x in ("NVLINK")`: INTRA_NODE_NVLINK contains "NVLINK" as a substring
    and must NOT take the NVLINK pool's tcp route."""
    assert "NVLINK" in "INTRA_NODE_NVLINK"  # the trap exists
    route, reason = route_rule(MemPoolType.INTRA_NODE_NVLINK, RouteSetting.auto)
    assert route is Route.engine and reason is Reason.engine_default
    for pool in MemPoolType:
        others = [p for p in MemPoolType if p is not pool]
        for other in others:
            assert pool is not other and pool != other
    with pytest.raises(ValueError):
        MemPoolType("NVLINK_INTRA")
    with pytest.raises(ValueError):
        MemPoolType("nvlink")  # exact, case-sensitive


def test_enums_are_exact_in_config(cfg_factory):
    from hydra.errors import ConfigCompositionException

    for bad in ("mem_pool=NVLIN", "mem_pool=nvlink", "mem_pool=INTRA_NODE"):
        with pytest.raises(ConfigCompositionException):
            cfg_factory(bad)


@pytest.mark.parametrize("transport", list(EngineTransport))
def test_engine_env_sets_or_unsets_every_managed_var(transport):
    env = engine_env(transport, 7)
    assert set(env) == set(MANAGED_MC_VARS)
    assert env["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "7"
    assert (env["MC_FORCE_TCP"] is not None) == (transport is EngineTransport.tcp)
    assert (env["MC_INTRANODE_NVLINK"] is not None) == (transport is EngineTransport.nvlink_intra)
    assert env["MC_FORCE_MNNVL"] is None and env["MC_FORCE_HCA"] is None


def _plan(cfg_factory, platform, *overrides):
    return plan_of(cfg_factory(*overrides), platform)


@pytest.mark.parametrize("pool,setting,platform", list(itertools.product(
    MemPoolType, RouteSetting, ["cpu", "1gpu", "2gpu", "gpu-noncuda-mooncake"])))
@pytest.mark.parametrize("fallback", list(FallbackPolicy))
def test_make_plan_every_combination(cfg_factory, pool, setting, platform, fallback):
    """Every pool x platform x route x fallback either plans consistently or is refused with
    a message naming a key."""
    p = PLATFORMS[platform]
    cuda_ok = p.cuda and p.mooncake_cuda
    try:
        plan = _plan(cfg_factory, p, f"mem_pool={pool.value}", f"transport.route={setting.value}",
                     f"transport.fallback={fallback.value}")
    except ConfigError as exc:
        assert str(exc).split("=")[0] in ("mem_pool", "transport.route")
        refused_gpu_tcp = (pool is MemPoolType.INTRA_NODE_NVLINK and setting is RouteSetting.tcp
                           and (cuda_ok or fallback is FallbackPolicy.strict))
        refused_no_cuda = (pool is MemPoolType.INTRA_NODE_NVLINK and not cuda_ok
                           and fallback is FallbackPolicy.strict)
        refused_nvlink_engine = pool is MemPoolType.NVLINK and setting is RouteSetting.engine
        assert refused_gpu_tcp or refused_no_cuda or refused_nvlink_engine
        return
    # tcp route never reads GPU memory
    if plan.route is Route.tcp:
        assert plan.buffer_device is Device.cpu and plan.engine_transport is None
        assert plan.declared_transport == "zmq-tcp"
    else:
        assert set(plan.mc_env) == set(MANAGED_MC_VARS)
    if pool is MemPoolType.INTRA_NODE_NVLINK and cuda_ok:
        assert plan.buffer_device is Device.cuda
        assert plan.engine_transport is EngineTransport.nvlink_intra
        assert plan.mc_env["MC_INTRANODE_NVLINK"] == "1" and plan.mc_env["MC_FORCE_TCP"] is None
        assert plan.prefill_gpus == (0,)
        assert plan.decode_gpus == ((1,) if p.cuda_devices >= 2 else (0,))
    elif pool is MemPoolType.INTRA_NODE_NVLINK:
        # degrade: host buffers, logged fallback, engine over TCP
        assert plan.buffer_device is Device.cpu and plan.events
        assert plan.events[0].event == "fallback"
        if plan.route is Route.engine:
            assert plan.engine_transport is EngineTransport.tcp
            assert plan.mc_env["MC_FORCE_TCP"] == "1" and plan.mc_env["MC_INTRANODE_NVLINK"] is None
    else:
        assert plan.buffer_device is Device.cpu and not plan.events


def test_nvlink_intra_on_host_buffers_is_refused(cfg_factory):
    with pytest.raises(ConfigError, match="transport.mooncake.transport"):
        _plan(cfg_factory, TWO_GPU, "transport.mooncake.transport=nvlink_intra")


def test_expandable_segments_refused_for_nvlink(cfg_factory):
    p = Platform(cuda_devices=2, mooncake_cuda=True,
                 env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"})
    with pytest.raises(ConfigError, match="PYTORCH_CUDA_ALLOC_CONF"):
        _plan(cfg_factory, p, "mem_pool=INTRA_NODE_NVLINK")
    ok = Platform(cuda_devices=2, mooncake_cuda=True,
                  env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert _plan(cfg_factory, ok, "mem_pool=INTRA_NODE_NVLINK").engine_transport is EngineTransport.nvlink_intra


def test_gpu_index_out_of_range(cfg_factory):
    with pytest.raises(ConfigError, match="endpoints.decode_gpus"):
        _plan(cfg_factory, ONE_GPU, "mem_pool=INTRA_NODE_NVLINK", "endpoints.decode_gpus=[1]")


@pytest.mark.parametrize("ranks,gpus,expected", [
    ((1, 1), 2, ((0,), (1,))),
    ((1, 1), 1, ((0,), (0,))),
    ((4, 4), 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
    ((2, 2), 2, ((0, 1), (0, 1))),
    ((3, 1), 8, ((0, 1, 2), (3,))),
])
def test_auto_gpu_placement(ranks, gpus, expected):
    assert gpu_placement(*ranks, None, None, gpus) == expected


def test_engine_tcp_on_gpu_buffers_allowed(cfg_factory):
    plan = _plan(cfg_factory, TWO_GPU, "mem_pool=INTRA_NODE_NVLINK", "transport.mooncake.transport=tcp")
    assert plan.buffer_device is Device.cuda and plan.engine_transport is EngineTransport.tcp
    assert plan.mc_env["MC_FORCE_TCP"] == "1"


# ---- one PID namespace for nvlink_intra (CUDA IPC) --------------------------------------------
def _other_pid_namespace() -> str:
    """The PID namespace of a process started with `unshare --pid --fork` (root only)."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a second PID namespace")
    proc = subprocess.run(["unshare", "--pid", "--fork", "readlink", "/proc/self/ns/pid"],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"unshare --pid failed here: {proc.stderr.strip()}")
    return proc.stdout.strip()


def test_nvlink_intra_across_pid_namespaces_is_refused_with_the_fix(cfg_factory):
    """Two containers on one node without --pid=host: the rule fires on the plan (no GPU)."""
    from orchestrator.preflight.doctor import CheckStatus as Status
    from orchestrator.preflight.doctor import check_process_space
    from orchestrator.profile.plan import same_process_space_rule
    from orchestrator.profile.platform import boot_id, pid_namespace

    other = _other_pid_namespace()
    mine = (pid_namespace(), boot_id())
    assert other.startswith("pid:[") and other != mine[0]
    plan = plan_of(cfg_factory("mem_pool=INTRA_NODE_NVLINK"), TWO_GPU)
    assert plan.engine_transport is EngineTransport.nvlink_intra
    why = same_process_space_rule(plan.engine_transport, mine, (other, mine[1]))
    assert why is not None and "--pid=host" in why and "hostPID: true" in why and other in why
    assert same_process_space_rule(plan.engine_transport, mine, mine) is None
    assert same_process_space_rule(plan.engine_transport, mine, ("", "")) is None  # an older peer
    tcp = plan_of(cfg_factory("mem_pool=NONE"), CPU)
    assert same_process_space_rule(tcp.engine_transport, mine, (other, mine[1])) is None
    # another kernel (boot id) is another host: nvlink_intra cannot reach it either
    assert "another kernel" in same_process_space_rule(plan.engine_transport, mine, (mine[0], "x" * 36))
    # the doctor applies the same rule
    check = check_process_space(plan.engine_transport, other, mine)
    assert check.status is Status.FAIL and "--pid=host" in check.detail
    assert check_process_space(plan.engine_transport, mine[0], mine).status is Status.OK


def test_bootstrap_messages_carry_the_process_space():
    from orchestrator.handoff.transport import wire

    nonce = "ab" * 16  # a session nonce (Trust II): every hello carries one
    hello = wire.decode(wire.encode("hello", rank=0, layout=[["x", "int32", 64]], fingerprint="", nonce=nonce,
                                    pid_ns="pid:[4026531836]", boot_id="b"))
    assert hello.pid_ns == "pid:[4026531836]" and hello.boot_id == "b"
    old = wire.decode(wire.encode("hello", rank=0, layout=[["x", "int32", 64]], fingerprint="", nonce=nonce))
    assert old.pid_ns is None  # a peer that predates them is still understood
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode("hello", rank=0, layout=[], fingerprint="", nonce=nonce, pid_ns=7))


def test_batch_caps_are_said_with_the_key_to_raise(cfg_factory):
    from orchestrator.results.reporting import _open_loop_warnings, batch_caps

    from .conftest import report_spec

    cfg = cfg_factory("workload.batch_size=64", "transport.coalesce=true", "workload.fill=ahead")
    (line,) = batch_caps(report_spec(cfg), sends=297, routed=1000)
    assert "capped at 8" in line and "workload.concurrency=8" in line
    cfg = cfg_factory("workload.batch_size=128", "workload.concurrency=2048", "buffers.size=1024")
    (line,) = batch_caps(report_spec(cfg), sends=1000, routed=1000)  # not coalesced: 10 blocks each
    assert "transport.max_inflight_blocks=1024" in line and "capped at 102" in line
    cfg = cfg_factory("workload.batch_size=64", "workload.concurrency=1024", "buffers.size=1024",
                      "transport.coalesce=true")
    assert batch_caps(report_spec(cfg), sends=180, routed=10000) == []  # ~56 per send
    (line,) = batch_caps(report_spec(cfg), sends=1000, routed=10000)  # 10 per send
    assert "10.0 requests each" in line and "workload.concurrency=1024" in line
    assert batch_caps(report_spec(cfg_factory()), sends=1000, routed=1000) == []
    # open loop: achieved < 95% of offered says so with both numbers; a sustained one is quiet
    (warn,) = _open_loop_warnings(offered=1000, achieved=583.6)
    assert "offered 1000" in warn and "583.6" in warn
    assert _open_loop_warnings(offered=1000, achieved=990.0) == []
