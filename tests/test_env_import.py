"""Reading a deployment's environment: serving.profile_from_env (the reverse of serving_env),
orchestrator.preflight.deployment (dotenv, `env` output, Kubernetes manifests, the traps, prefill against
decode) and `python -m orchestrator.doctor --env-file / --manifest / --run`. All on CPU."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import subprocess
import sys

import pytest
import yaml

from orchestrator.job.check import check_profile
from orchestrator.preflight import deployment as dep
from orchestrator.preflight.compose import load_profile
from orchestrator.preflight.deployment import DisaggregationMode as Role
from orchestrator.preflight.deployment import Level, Wheel
from orchestrator.preflight.serving import profile_from_env, serving_env
from orchestrator.profile.config import ConfigError, EngineTransportSetting, FallbackPolicy, MemPoolType, RouteSetting
from orchestrator.profile.plan import Platform
from orchestrator.results.schema import Results

from .conftest import CONF, ROOT, typed_cfg
from .test_doctor import clean_env

# Machines the round trip plans for: the rule book needs an RDMA device for transport=rdma.
GPU = Platform(cuda_devices=8, mooncake_cuda=True, rdma_devices=("mlx5_0",))
CPU = Platform(rdma_devices=("mlx5_0",))
NO_NVLINK = Wheel("mooncake-transfer-engine-non-cuda 0.3.13.post1", False)
CUDA13 = Wheel("mooncake-transfer-engine-cuda13 0.3.14", True)
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _cfg(*overrides: str):
    return typed_cfg(*overrides)


def read_back(plan, base: tuple[str, ...], platform: Platform):
    """serving_env(plan), as a deployment would have it (unset names absent), read back and
    planned again by the rule book on the same machine."""
    env = {k: v for k, v in serving_env(plan).items() if v is not None}
    overrides = profile_from_env(env)
    cfg = _cfg(*base, *(f"{k}={v}" for k, v in overrides.items()))
    return check_profile(cfg, platform)


def served(plan) -> dict:
    """The plan as the environment carries it. Three things have no variable: the fallback
    policy; forced engine vs default engine (both mean "no tcp route variable"); a degraded
    INTRA_NODE_NVLINK plan, which serving_env gives SGLang as no pool (mem_pool NONE)."""
    d = plan.as_dict()
    d.pop("fallback")
    if d["route_reason"] == "route_forced_engine":
        d["route_reason"] = "engine_default"
    if d.pop("events"):
        d["mem_pool"] = "NONE"
    return d


@pytest.mark.parametrize("name,platform", [("8 GPUs", GPU), ("CPU", CPU)])
def test_round_trip_every_combination_the_rule_book_allows(name, platform):
    allowed = 0
    for pool, route, transport, fallback in itertools.product(
            MemPoolType, RouteSetting, EngineTransportSetting, FallbackPolicy):
        cfg = copy.deepcopy(_cfg())  # the four keys set directly: composing 96 profiles is slow
        cfg.mem_pool.type, cfg.transport.route, cfg.transport.fallback = pool, route, fallback
        cfg.transport.mooncake.transport = transport
        try:
            plan = check_profile(cfg, platform)
        except ConfigError:
            continue
        allowed += 1
        back = read_back(plan, (), platform)
        assert served(back) == served(plan), (pool, route, transport, fallback)
        if not plan.events and fallback is FallbackPolicy.strict:  # then the whole plan
            expected = plan.as_dict()
            if expected["route_reason"] == "route_forced_engine":
                expected["route_reason"] = "engine_default"
            assert back.as_dict() == expected, (pool, route, transport)
    assert allowed >= (40 if platform is GPU else 30)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_round_trip_every_experiment(experiment):
    """The implied overrides on top of the experiment give its plan again (GPU placement,
    completion and all); on a CPU box, GPU profiles degrade and read back as host buffers."""
    base = (f"experiment={experiment}",)
    plan = check_profile(_cfg(*base), GPU)
    back = read_back(plan, base, GPU)
    assert back.as_dict() == plan.as_dict()  # GPU placement and completion included
    degrade = (*base, "transport.fallback=degrade")
    plan = check_profile(_cfg(*degrade), CPU)
    assert served(read_back(plan, base, CPU)) == served(plan)


def test_profile_from_env_reads_as_sglang_and_mooncake_do():
    read = profile_from_env
    assert read({})["mem_pool"] == "NONE" and read({})["transport.mooncake.transport"] == "rdma"
    assert read({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "True"})["mem_pool"] == "NVLINK"
    assert read({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "intra_node_nvlink"})["mem_pool"] == "NONE"
    assert read({"MC_INTRANODE_NVLINK": "0"})["transport.mooncake.transport"] == "nvlink_intra"
    both = {"MC_INTRANODE_NVLINK": "1", "MC_FORCE_TCP": ""}
    assert read(both)["transport.mooncake.transport"] == "tcp"  # MC_FORCE_TCP is tested first
    assert read({"SGLANG_MOONCAKE_SEND_AUX_TCP": "0"})["transport.route"] == "auto"  # a boolean
    assert read({"SGLANG_MOONCAKE_SEND_AUX_TCP": "yes"})["transport.route"] == "tcp"
    assert read({})["transport.mooncake.tcp_progress_timeout_s"] == "30"  # Mooncake's default
    assert read({"SGLANG_ENABLE_DISAGG_SAMPLING_MASK": "true"})["buffers.enable_sampling_mask"] == "true"
    with pytest.raises(ConfigError, match="MC_TCP_PROGRESS_TIMEOUT_SEC"):
        read({"MC_TCP_PROGRESS_TIMEOUT_SEC": "5s"})


# --- parsing --------------------------------------------------------------------------------------

def test_parse_dotenv():
    text = ("# comment\n\nexport A=1\nB='x #y'\nC=\"q\\\"uote\"\nD=plain # trailing\nE=\n")
    assert dep.parse_dotenv(text, "f") == {"A": "1", "B": "x #y", "C": 'q"uote', "D": "plain", "E": ""}
    with pytest.raises(dep.InputError, match=r"f:2: expected NAME=VALUE"):
        dep.parse_dotenv("A=1\nthis is not a line\n", "f")
    with pytest.raises(dep.InputError, match="unterminated"):
        dep.parse_dotenv("A='open\n", "f")


def test_parse_env_output_keeps_raw_values_and_continuations():
    text = "A=\"quoted\"\nMULTI=line one\nline two\nB=x=y\n"
    assert dep.parse_env_output(text) == {"A": '"quoted"', "MULTI": "line one\nline two", "B": "x=y"}


def _pod_spec(containers, **flags):
    return {**flags, "containers": containers}


def _container(name, env, args=()):
    return {"name": name, "image": "lmsysorg/sglang:v0.5.23", "args": list(args),
            "env": [{"name": k, "value": v} for k, v in env.items()]}


@pytest.mark.parametrize("kind", ["Pod", "Deployment", "StatefulSet", "LeaderWorkerSet", "List"])
def test_parse_manifest_shapes(kind):
    spec = _pod_spec([_container("sglang", {"MC_FORCE_TCP": "1"})])
    meta = {"name": "pd"}
    docs = {
        "Pod": {"kind": "Pod", "metadata": meta, "spec": spec},
        "Deployment": {"kind": "Deployment", "metadata": meta, "spec": {"template": {"spec": spec}}},
        "StatefulSet": {"kind": "StatefulSet", "metadata": meta, "spec": {"template": {"spec": spec}}},
        "LeaderWorkerSet": {"kind": "LeaderWorkerSet", "metadata": meta, "spec": {"leaderWorkerTemplate": {
            "leaderTemplate": {"spec": spec}, "workerTemplate": {"spec": spec}}}},
        "List": {"kind": "List", "items": [{"kind": "Pod", "metadata": meta, "spec": spec}]},
    }
    found = dep.parse_manifest(yaml.safe_dump(docs[kind]), "m.yaml")
    assert len(found) == (2 if kind == "LeaderWorkerSet" else 1)
    assert all(e.env == {"MC_FORCE_TCP": "1"} for e in found)
    if kind == "LeaderWorkerSet":
        assert [e.pod.name for e in found] == ["LeaderWorkerSet/pd (leader)", "LeaderWorkerSet/pd (worker)"]


def test_parse_manifest_value_from_config_maps_and_roles():
    text = """
kind: ConfigMap
metadata: {name: cm}
data: {SGLANG_MOONCAKE_CUSTOM_MEM_POOL: INTRA_NODE_NVLINK, MODE: x}
---
kind: Service
metadata: {name: svc}
---
kind: Deployment
metadata: {name: sglang}
spec:
  template:
    spec:
      shareProcessNamespace: true
      nodeSelector: {kubernetes.io/hostname: node-1}
      containers:
        - name: a
          args: [--disaggregation-mode, decode]
          envFrom: [{configMapRef: {name: cm}}, {secretRef: {name: creds}}]
          env:
            - {name: MC_INTRANODE_NVLINK, valueFrom: {secretKeyRef: {name: s, key: k}}}
            - {name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
            - {name: M, valueFrom: {configMapKeyRef: {name: cm, key: MODE}}}
        - name: prefill-server
          env: [{name: SGLANG_ENABLE_DISAGG_SAMPLING_MASK, value: "1"}]
"""
    a, b = dep.parse_manifest(text, "m.yaml")
    assert a.role is Role.decode and b.role is Role.prefill
    assert a.env == {"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK", "MODE": "x",
                     "MC_INTRANODE_NVLINK": "", "M": "x"}
    assert dict(a.unknown) == {"*": "envFrom secretRef creds",
                               "MC_INTRANODE_NVLINK": "valueFrom secretKeyRef s, k",
                               "POD_IP": "valueFrom fieldRef status.podIP"}
    assert a.pod.share_process_namespace and not a.pod.host_pid and a.pod.node == "node-1"
    reading = dep.judge(a, CUDA13, load_profile)
    assert reading.plan is not None and reading.transport == "nvlink_intra"
    texts = {f.variable: f for f in reading.findings}
    assert texts["MC_INTRANODE_NVLINK"].level is Level.WARN and "presence" in texts["MC_INTRANODE_NVLINK"].text
    assert texts["unknown"].level is Level.OK and "POD_IP" in texts["unknown"].text


@pytest.mark.parametrize("text,needle", [
    ("a: [", "not valid YAML"),
    ("kind: Service\nmetadata: {name: x}\n", "no container found"),
])
def test_parse_manifest_unreadable(text, needle):
    with pytest.raises(dep.InputError, match=needle):
        dep.parse_manifest(text, "m.yaml")


# --- the traps, each from two dotenv files and from one manifest ----------------------------------

POOL = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"
NVL = {POOL: "INTRA_NODE_NVLINK", "MC_INTRANODE_NVLINK": "1", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5"}

# trap: (prefill env, decode env, wheel, [(level, variable, where: prefill|decode|pair, needle)])
TRAPS = {
    "nvlink_zero_is_on": ({"MC_INTRANODE_NVLINK": "0"}, {"MC_INTRANODE_NVLINK": "0"}, CUDA13, [
        (Level.WARN, "MC_INTRANODE_NVLINK", "prefill", "still turns it ON"),
        (Level.FAIL, "MC_INTRANODE_NVLINK", "decode", "cannot register")]),
    "intra_pool_without_nvlink_var": (
        {POOL: "INTRA_NODE_NVLINK", "MC_FORCE_TCP": "1"}, {POOL: "INTRA_NODE_NVLINK", "MC_FORCE_TCP": "1"},
        CUDA13, [(Level.FAIL, "MC_INTRANODE_NVLINK", "prefill", "Mooncake comes up on TCP"),
                 (Level.FAIL, "MC_INTRANODE_NVLINK", "decode", "export MC_INTRANODE_NVLINK=1")]),
    "intra_pool_nothing_set": ({POOL: "INTRA_NODE_NVLINK"}, {POOL: "INTRA_NODE_NVLINK"}, CUDA13, [
        (Level.FAIL, "MC_INTRANODE_NVLINK", "prefill", "RDMA where the node has an HCA, else TCP")]),
    "expandable_segments": (
        {**NVL, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        {**NVL, "PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:true"}, CUDA13, [
            (Level.FAIL, "PYTORCH_CUDA_ALLOC_CONF", "prefill", "remove expandable_segments:True"),
            (Level.FAIL, "PYTORCH_ALLOC_CONF", "decode", "cannot register")]),
    "wheel_without_nvlink_intra": (NVL, NVL, NO_NVLINK, [
        (Level.WARN, "mooncake wheel", "prefill", "built without nvlink_intra"),
        (Level.WARN, "mooncake wheel", "decode", "mooncake-transfer-engine-cuda13")]),
    "layout_switches_disagree": ({"SGLANG_ENABLE_DISAGG_SAMPLING_MASK": "1"}, {}, CUDA13, [
        (Level.FAIL, "SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "pair", "field 6")]),
    "send_aux_tcp": ({"SGLANG_MOONCAKE_SEND_AUX_TCP": "1"}, {**NVL, "SGLANG_MOONCAKE_SEND_AUX_TCP": "1"}, CUDA13, [
        (Level.WARN, "SGLANG_MOONCAKE_SEND_AUX_TCP", "prefill", "ZMQ tcp route"),
        (Level.FAIL, "SGLANG_MOONCAKE_SEND_AUX_TCP", "decode", "GPU pointers"),
        (Level.FAIL, POOL, "pair", "differs")]),
    "transports_disagree": ({"MC_FORCE_TCP": "1"}, {}, CUDA13, [
        (Level.FAIL, "MC_FORCE_TCP", "pair", "different Mooncake transports")]),
    "pool_unknown_to_sglang": ({POOL: "intra_node_nvlink"}, {POOL: "intra_node_nvlink"}, CUDA13, [
        (Level.WARN, POOL, "prefill", "case-sensitive")]),
    "protocol_is_not_the_transport": (
        {"MOONCAKE_PROTOCOL": "nvlink_intra", "MC_FORCE_TCP": "1"}, {"MC_FORCE_TCP": "1"}, CUDA13, [
            (Level.WARN, "MOONCAKE_PROTOCOL", "prefill", "does not choose the transport")]),
    "multi_node_nvlink": ({"MC_FORCE_MNNVL": "1"}, {"MC_FORCE_MNNVL": "1", "MC_FORCE_TCP": "1"}, CUDA13, [
        (Level.FAIL, "MC_FORCE_MNNVL", "prefill", "-DUSE_MNNVL=ON"),
        (Level.WARN, "MC_FORCE_MNNVL", "decode", "ignored (MC_FORCE_TCP is tested first)")]),
    "sampling_mask_max_tokens": ({"SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS": "256"}, {}, CUDA13, [
        (Level.FAIL, "SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS", "prefill", "refuses to start")]),
    "host_ip_loopback": ({"SGLANG_HOST_IP": "127.0.0.1"}, {}, CUDA13, [
        (Level.WARN, "SGLANG_HOST_IP", "prefill", "is a loopback address")]),
    "host_ip_link_local": ({}, {"HOST_IP": "169.254.10.2"}, CUDA13, [
        (Level.WARN, "HOST_IP", "decode", "is link-local")]),
    "new_pool_name_only": ({"SGLANG_CUSTOM_MEM_POOL": "NVLINK"}, {"SGLANG_CUSTOM_MEM_POOL": "NVLINK"}, CUDA13, [
        (Level.WARN, "SGLANG_CUSTOM_MEM_POOL", "prefill", "SGLang 0.5.23 does not read SGLANG_CUSTOM_MEM_POOL"),
        (Level.WARN, "SGLANG_CUSTOM_MEM_POOL", "decode", "PR #38024")]),
    "pool_names_differ": ({POOL: "NVLINK", "SGLANG_CUSTOM_MEM_POOL": "BAREX"}, {POOL: "NVLINK"}, CUDA13, [
        (Level.WARN, "SGLANG_CUSTOM_MEM_POOL", "prefill", "would place the buffers differently")]),
    "waiting_timeout_is_not_transferring": ({"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "600"}, {}, CUDA13, [
        (Level.OK, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "prefill", "stays in Transferring past it")]),
    "customized_info_capacity_differs": ({"SGLANG_DISAGG_CUSTOMIZED_INFO_MAX_BYTES": "8192"}, {}, CUDA13, [
        (Level.OK, "SGLANG_DISAGG_CUSTOMIZED_INFO_MAX_BYTES", "prefill", "a preview"),
        (Level.FAIL, "SGLANG_DISAGG_CUSTOMIZED_INFO_MAX_BYTES", "pair", "PR #40107")]),
    "bad_timeout": ({"MC_TCP_PROGRESS_TIMEOUT_SEC": "5s"}, {"MC_TCP_PROGRESS_TIMEOUT_SEC": "5"}, CUDA13, [
        (Level.FAIL, "MC_TCP_PROGRESS_TIMEOUT_SEC", "prefill", "whole number of seconds")]),
}


def _check(readings, crossed, expected):
    where = {"prefill": readings[0].findings, "decode": readings[1].findings,
             "pair": [f for _, _, fs in crossed for f in fs]}
    for level, variable, side, needle in expected:
        hits = [f for f in where[side] if f.variable == variable and f.level is level]
        assert hits and any(needle in f.text for f in hits), (side, variable, where[side])


def _judge_all(environments, wheel):
    readings = [dep.judge(e, wheel, load_profile) for e in environments]
    return readings, [(a, b, dep.cross_check(a, b)) for a, b in dep.pairs(readings)]


def _dotenv(env: dict) -> str:
    return "".join(f"{k}='{v}'\n" for k, v in env.items())


def _manifest(prefill: dict, decode: dict, **pod_flags) -> str:
    spec = _pod_spec([_container("prefill", prefill, ["--disaggregation-mode", "prefill"]),
                      _container("decode", decode, ["--disaggregation-mode", "decode"])], **pod_flags)
    return yaml.safe_dump({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "pd"},
                           "spec": {"template": {"spec": spec}}})


@pytest.mark.parametrize("trap", sorted(TRAPS))
def test_trap_from_dotenv_files(trap, tmp_path):
    prefill, decode, wheel, expected = TRAPS[trap]
    environments = []
    for role, env in (("prefill", prefill), ("decode", decode)):
        path = tmp_path / f"{role}.env"
        path.write_text(_dotenv(env))
        environments.append(dep.env_file_environment(dep.parse_dotenv(path.read_text(), str(path)), str(path)))
    assert [e.role for e in environments] == [Role.prefill, Role.decode]
    _check(*_judge_all(environments, wheel), expected)


@pytest.mark.parametrize("trap", sorted(TRAPS))
def test_trap_from_manifest(trap):
    prefill, decode, wheel, expected = TRAPS[trap]
    environments = dep.parse_manifest(_manifest(prefill, decode, shareProcessNamespace=True), "pd.yaml")
    assert [e.role for e in environments] == [Role.prefill, Role.decode]
    _check(*_judge_all(environments, wheel), expected)


def test_pid_namespace_from_dotenv_files_warns(tmp_path):
    envs = [dep.env_file_environment(dict(NVL), f"{r}.env") for r in ("prefill", "decode")]
    readings, crossed = _judge_all(envs, CUDA13)
    _check(readings, crossed, [(Level.WARN, "PID namespace", "pair", "--pid=host")])


@pytest.mark.parametrize("flags,level,needle", [
    ({}, Level.FAIL, "shareProcessNamespace: true"),
    ({"shareProcessNamespace": True}, Level.OK, "shareProcessNamespace: true"),
    ({"hostPID": True}, Level.OK, "hostPID: true"),
])
def test_pid_namespace_one_pod(flags, level, needle):
    envs = dep.parse_manifest(_manifest(NVL, NVL, **flags), "pd.yaml")
    _check(*_judge_all(envs, CUDA13), [(level, "PID namespace", "pair", needle)])


@pytest.mark.parametrize("host_pid,nodes,level,needle", [
    ((False, True), (None, None), Level.FAIL, "Deployment/prefill lacks hostPID"),
    ((True, True), (None, None), Level.OK, "both set hostPID"),
    ((True, True), ("n1", "n2"), Level.FAIL, "put both on one node"),
])
def test_pid_namespace_two_pods(host_pid, nodes, level, needle):
    docs = []
    for role, pid, node in zip(("prefill", "decode"), host_pid, nodes):
        spec = _pod_spec([_container("sglang", NVL, ["--disaggregation-mode", role])], hostPID=pid)
        if node:
            spec["nodeName"] = node
        docs.append({"kind": "Deployment", "metadata": {"name": role}, "spec": {"template": {"spec": spec}}})
    envs = dep.parse_manifest(yaml.safe_dump_all(docs), "pd.yaml")
    _check(*_judge_all(envs, CUDA13), [(level, "PID namespace", "pair", needle)])


def test_prefill_and_decode_images_that_differ_warn():
    """Version skew from a manifest: the images carry SGLang, Mooncake and torch."""
    docs = []
    for role, tag in (("prefill", "v0.5.23"), ("decode", "v0.5.20")):
        c = _container("sglang", {}, ["--disaggregation-mode", role])
        c["image"] = f"lmsysorg/sglang:{tag}"
        docs.append({"kind": "Deployment", "metadata": {"name": role},
                     "spec": {"template": {"spec": _pod_spec([c])}}})
    _check(*_judge_all(dep.parse_manifest(yaml.safe_dump_all(docs), "pd.yaml"), CUDA13),
           [(Level.WARN, "image", "pair", "Failed to get segment descriptor")])
    same = _judge_all(dep.parse_manifest(_manifest({}, {}), "pd.yaml"), CUDA13)[1]
    assert not [f for _, _, fs in same for f in fs if f.variable == "image"]


def test_a_loopback_address_against_another_host_fails_across_pods(tmp_path):
    """SGLANG_HOST_IP=127.0.0.1 on the prefill while the decode advertises another host's
    address: FAIL from two env files and from two pods; two containers of one pod share
    loopback (no FAIL)."""
    prefill, decode = {"SGLANG_HOST_IP": "127.0.0.1"}, {"SGLANG_HOST_IP": "10.0.0.2"}
    envs = [dep.env_file_environment(prefill, "prefill.env"), dep.env_file_environment(decode, "decode.env")]
    readings, crossed = _judge_all(envs, CUDA13)
    _check(readings, crossed, [(Level.FAIL, "SGLANG_HOST_IP", "pair", "the prefill advertises 127.0.0.1")])
    assert readings[1].address.startswith("10.0.0.2 (step SGLANG_HOST_IP")
    docs = [{"kind": "Deployment", "metadata": {"name": role}, "spec": {"template": {"spec": _pod_spec(
        [_container("sglang", env, ["--disaggregation-mode", role])])}}}
        for role, env in (("prefill", prefill), ("decode", decode))]
    _check(*_judge_all(dep.parse_manifest(yaml.safe_dump_all(docs), "pd.yaml"), CUDA13),
           [(Level.FAIL, "SGLANG_HOST_IP", "pair", "cannot reach it")])
    one_pod = _judge_all(dep.parse_manifest(_manifest(prefill, decode), "pd.yaml"), CUDA13)[1]
    assert not [f for _, _, fs in one_pod for f in fs if f.variable == "SGLANG_HOST_IP"]


def test_the_address_each_side_would_advertise_and_the_step():
    """Which address and which step of SGLang's rule, from a manifest: the pod's own address by
    default, the node's default route under hostNetwork (WARN), a fieldRef, the NIC variable."""
    pod_ip = {"kind": "Deployment", "metadata": {"name": "p"}, "spec": {"template": {"spec": _pod_spec(
        [{"name": "prefill", "args": ["--disaggregation-mode", "prefill"],
          "env": [{"name": "SGLANG_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}])}}}
    host_net = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {"spec": _pod_spec(
        [_container("decode", {}, ["--disaggregation-mode", "decode"])], hostNetwork=True)}}}
    nic = {"kind": "Deployment", "metadata": {"name": "n"}, "spec": {"template": {"spec": _pod_spec(
        [_container("decode", {"SGLANG_LOCAL_IP_NIC": "ib0"}, ["--disaggregation-mode", "decode"])],
        hostNetwork=True)}}}
    plain = dict(pod_ip, metadata={"name": "q"})
    plain["spec"] = {"template": {"spec": _pod_spec([_container("prefill", {}, ["--disaggregation-mode", "prefill"])])}}
    readings = _judge_all(dep.parse_manifest(yaml.safe_dump_all([pod_ip, host_net, nic, plain]), "pd.yaml"),
                          CUDA13)[0]
    a, b, c, d = readings
    assert a.address.startswith("the value of SGLANG_HOST_IP (valueFrom fieldRef status.podIP; step SGLANG_HOST_IP)")
    assert not [f for f in a.findings if f.level is not Level.OK]  # no "read as unset" WARN for it
    assert "step default route: hostNetwork" in b.address
    _check([b, c], [], [(Level.WARN, "SGLANG_LOCAL_IP_NIC", "prefill", "hostNetwork: true"),
                        (Level.OK, "SGLANG_LOCAL_IP_NIC", "decode", "netifaces")])
    assert "step SGLANG_LOCAL_IP_NIC" in c.address and "the pod's eth0" in d.address


@pytest.mark.parametrize("env", [{}, {POOL: "NVLINK"}, {"SGLANG_CUSTOM_MEM_POOL": "BAREX"},
                                 {POOL: "NVLINK", "SGLANG_CUSTOM_MEM_POOL": "BAREX"},
                                 {POOL: "INTRA_NODE_NVLINK", "SGLANG_CUSTOM_MEM_POOL": ""}])
def test_which_release_reads_which_pool_name(env, monkeypatch):
    """SGLang 0.5.23 reads SGLANG_MOONCAKE_CUSTOM_MEM_POOL only; PR #38024 (a preview: its
    declaration, EnvStrWithAlias(None, deprecated_name=...), over 0.5.23's own environ code)
    reads SGLANG_CUSTOM_MEM_POOL, else the old name."""
    from orchestrator.preflight.serving import pool_value

    from .helpers import sglang_oracle

    try:
        envs = sglang_oracle.pool_envs_pr38024()
    except sglang_oracle.OracleUnavailable as exc:
        pytest.skip(str(exc))
    for var in (POOL, "SGLANG_CUSTOM_MEM_POOL"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert pool_value(env) == envs.SGLANG_MOONCAKE_CUSTOM_MEM_POOL.get()
    with pytest.warns(DeprecationWarning) if POOL in env and "SGLANG_CUSTOM_MEM_POOL" not in env \
            else contextlib.nullcontext():
        assert pool_value(env, pr38024=True) == envs.SGLANG_CUSTOM_MEM_POOL.get()


def test_canonical_env_has_no_trap():
    """What export_env prints for the NVLink profile, read back: no FAIL, no WARN."""
    env = {k: v for k, v in serving_env(check_profile(_cfg("mem_pool=INTRA_NODE_NVLINK"), GPU)).items()
           if v is not None}
    envs = dep.parse_manifest(_manifest(env, env, shareProcessNamespace=True), "pd.yaml")
    readings, crossed = _judge_all(envs, CUDA13)
    every = [f for r in readings for f in r.findings] + [f for _, _, fs in crossed for f in fs]
    assert all(f.level is Level.OK for f in every), every
    assert readings[0].profile == ["mem_pool=INTRA_NODE_NVLINK", "transport.route=auto",
                                   "transport.mooncake.transport=nvlink_intra",
                                   "transport.mooncake.tcp_progress_timeout_s=5",
                                   "buffers.enable_sampling_mask=false"]
    assert "buffers on cuda, route engine" in dep.plan_line(readings[0])


def test_an_empty_mc_value_is_still_set():
    reading = dep.judge(dep.Environment("x", {"MC_FORCE_TCP": ""}), CUDA13, load_profile)
    assert reading.transport == "tcp"
    assert [(f.level, f.variable) for f in reading.findings] == [(Level.WARN, "MC_FORCE_TCP")]


def test_bad_timeout_is_a_fail_naming_the_variable():
    reading = dep.judge(dep.Environment("x", {"MC_TCP_PROGRESS_TIMEOUT_SEC": "soon"}), CUDA13, load_profile)
    assert reading.plan is None
    assert [(f.level, f.variable) for f in reading.findings] == [(Level.FAIL, "MC_TCP_PROGRESS_TIMEOUT_SEC")]


# --- the CLI --------------------------------------------------------------------------------------

def doctor(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.doctor", *args], cwd=ROOT,
                          env=clean_env(), input=stdin, capture_output=True, text=True, timeout=300)


def test_cli_two_env_files_exit_1_with_fails(tmp_path):
    (tmp_path / "prefill.env").write_text(_dotenv({**NVL, "SGLANG_ENABLE_DISAGG_SAMPLING_MASK": "1"}))
    (tmp_path / "decode.env").write_text(_dotenv(NVL))
    proc = doctor("--env-file", str(tmp_path / "prefill.env"), "--env-file", str(tmp_path / "decode.env"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "profile: python -m orchestrator mem_pool=INTRA_NODE_NVLINK" in out
    assert "FAIL  SGLANG_ENABLE_DISAGG_SAMPLING_MASK: differs" in out
    assert out.splitlines()[-1].startswith("=> 2 environment(s), 1 prefill/decode pair(s)")


def test_cli_env_output_on_stdin_exit_0():
    proc = doctor("--env-file", "-", "--json", stdin="PATH=/usr/bin\nMC_FORCE_TCP=1\nHOME=/root\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] is True and data["pairs"] == []
    (one,) = data["environments"]
    assert one["label"] == "stdin (env output)" and one["plan"]["declared_transport"] == "mooncake-tcp"


def test_cli_manifest_names_the_installed_wheel(tmp_path):
    """The wheel where the doctor runs: on this project's CPU boxes the non-cuda one."""
    from orchestrator.profile.platform import mooncake_distribution

    dist = mooncake_distribution()
    if dist is None or not dist[0].endswith("-non-cuda"):
        pytest.skip("needs the non-cuda Mooncake wheel")
    path = tmp_path / "pd.yaml"
    path.write_text(_manifest(NVL, NVL, shareProcessNamespace=True))
    proc = doctor("--manifest", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"WARN  mooncake wheel: the wheel installed where this doctor runs, {dist[0]} {dist[1]}" in proc.stdout
    assert "OK    PID namespace: both containers in Deployment/pd, shareProcessNamespace: true." in proc.stdout


@pytest.mark.parametrize("args,stdin,needle", [
    (["--env-file", "/nonexistent/x.env"], None, "No such file"),
    (["--manifest", "{manifest}"], None, "not valid YAML"),
    (["--env-file", "{dotenv}"], None, "expected NAME=VALUE"),
    (["--run"], None, "--run needs --env-file"),
    (["--env-file", "{good}", "buffers.size=0"], None, "buffers.size=0"),
])
def test_cli_unreadable_input_is_one_line_exit_2(args, stdin, needle, tmp_path):
    (tmp_path / "bad.yaml").write_text("spec: [\n")
    (tmp_path / "bad.env").write_text("not a line\n")
    (tmp_path / "good.env").write_text("MC_FORCE_TCP=1\n")
    args = [a.format(manifest=tmp_path / "bad.yaml", dotenv=tmp_path / "bad.env",
                     good=tmp_path / "good.env") for a in args]
    proc = doctor(*args, stdin=stdin)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


def test_cli_refuses_overrides_the_environment_decides(tmp_path):
    path = tmp_path / "x.env"
    path.write_text("MC_FORCE_TCP=1\n")
    proc = doctor("--env-file", str(path), "mem_pool=NVLINK")
    assert proc.returncode == 2 and "mem_pool is what the environment decides" in proc.stderr


def test_cli_run_refuses_after_a_fail(tmp_path):
    path = tmp_path / "x.env"
    path.write_text("MC_INTRANODE_NVLINK=0\n")
    proc = doctor("--env-file", str(path), "--run")
    assert proc.returncode == 1 and "not run" in proc.stderr
    assert "$ python -m orchestrator" not in proc.stdout


@pytest.mark.integration
def test_cli_run_runs_the_implied_profile_here(tmp_path):
    """A host-buffer deployment over Mooncake's TCP transport, run for real on this box."""
    path = tmp_path / "x.env"
    path.write_text("MC_FORCE_TCP=1\nMC_TCP_PROGRESS_TIMEOUT_SEC=5\n")
    proc = doctor("--env-file", str(path), "--run", "workload.requests=20", "buffers.size=16",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("$ python -m orchestrator workload.requests=20 buffers.size=16 "
            f"hydra.run.dir={tmp_path / 'run'} mem_pool=NONE") in proc.stdout
    results = Results.read(tmp_path / "run")
    assert results.verified == 20 and results.exit_code == 0
    assert results.plan.declared_transport == "mooncake-tcp"


@pytest.mark.parametrize("doc,command", [
    ("docs/preflight.md", "$ python -m orchestrator.doctor --env-file docs/examples/prefill.env "
                  "--env-file docs/examples/decode.env"),
    ("docs/preflight.md", "$ python -m orchestrator.doctor --manifest docs/examples/pd-one-pod.yaml"),
])
def test_documented_examples_are_what_the_doctor_prints(doc, command):
    """The examples in the README and docs/preflight.md, run again: same output, same exit."""
    from orchestrator.profile.platform import mooncake_distribution

    dist = mooncake_distribution()
    if dist is None or " ".join(dist) != "mooncake-transfer-engine-non-cuda 0.3.13.post1":
        pytest.skip("the examples were captured with mooncake-transfer-engine-non-cuda 0.3.13.post1")
    text = (ROOT / doc).read_text()
    for name in ("prefill.env", "decode.env", "pd-one-pod.yaml"):  # the inputs, as shown
        if name in command:
            assert (ROOT / "docs" / "examples" / name).read_text() in text
    block = text[text.index(command) + len(command) + 1:]
    block = block[:block.index("\n```")]
    expected, exit_line = block.rsplit("\n", 1)
    proc = doctor(*command.split()[4:])
    assert proc.stdout.rstrip("\n") == expected
    assert exit_line == f"(exit {proc.returncode})"
