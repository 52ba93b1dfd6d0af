"""`python -m orchestrator.doctor [overrides] [--json]`: can this machine run the profile as
declared?

The overrides are Hydra overrides, composed exactly as the main CLI composes them (schema,
``conf/config.yaml``, ``validate``), then planned with :func:`orchestrator.profile.plan.make_plan`
against the detected platform. Each check prints one line: OK, WARN or FAIL, its name, and a
sentence saying what was found and what to do. Exit codes: 0 when no check FAILs (the profile
can run as declared; WARNs are advice), 1 when one does, 2 when the profile itself is broken
(Hydra cannot compose it or ``validate`` rejects it; one ``error: ...`` line on stderr).

Every check is a small function returning a :class:`Check`; the ones that judge take what
they judge as arguments (an env mapping, a probe result, a bind function), so each status is
unit-testable without the machine. The ``probe_*`` functions are the only ones that look at
the machine.

``--env-file FILE`` (a dotenv file; ``-``: ``env`` output on stdin) and ``--manifest FILE.yaml``
(a Kubernetes manifest), each repeatable, judge a deployment's environment instead: the
profile it implies, the plan SGLang and Mooncake would run with it, each trap, and a prefill
against a decode (:mod:`orchestrator.preflight.deployment` does the reading and judging; this is the
command line). ``--run`` then runs the implied profile here. Exit codes as above; 2 also for
input that cannot be read (one ``error: ...`` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import random
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from orchestrator.handoff.transport.ports import port_is_free, rpc_port_range
from orchestrator.job import failure
from orchestrator.job.check import DoctorSpec, doctor_spec
from orchestrator.preflight.compose import (
    ProfileError,
    error_exit,
    load_profile,
    overrides_dict,
    profile_label,
    profile_parser,
)
from orchestrator.profile.config import (
    BuffersConfig,
    ConfigError,
    EndpointsConfig,
    LayoutConfig,
    MemPoolConfig,
    MemPoolType,
    Role,
    TransportConfig,
    is_loopback,
)
from orchestrator.profile.plan import (
    ALLOC_CONF_VARS,
    OFF_LOOKING,
    Device,
    EngineTransport,
    Plan,
    Platform,
    Route,
    expandable_segments,
    make_plan,
)
from orchestrator.profile.sharing import MPS_CONTROL

if TYPE_CHECKING:
    from orchestrator.preflight.address import Host
    from orchestrator.preflight.deployment import Environment, Finding, Reading, Wheel
    from orchestrator.profile.versions import Versions

Crossed = list[tuple["Reading", "Reading", list["Finding"]]]  # prefill, decode, what their pair shows

# ---------------------------------------------------------------------------------------------
# Results


class CheckStatus(str, Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


_RANK = {CheckStatus.OK: 0, CheckStatus.WARN: 1, CheckStatus.FAIL: 2}


@dataclass(frozen=True)
class Check:
    name: str
    status: CheckStatus
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status.value, "detail": self.detail}

    def line(self) -> str:
        return f"{self.status.value:<4}  {self.name:<10}  {self.detail}"


def _verdict(name: str, findings: Sequence[tuple[CheckStatus, str]]) -> Check:
    """One Check from (status, sentence) findings: the worst status, the sentences in order."""
    status = max((s for s, _ in findings), key=_RANK.__getitem__, default=CheckStatus.OK)
    return Check(name, status, " ".join(text for _, text in findings))


# ---------------------------------------------------------------------------------------------
# What the profile asks of the machine (also when the rule book refuses it here)


def intended_plan(mem_pool: MemPoolConfig, transport: TransportConfig, e: EndpointsConfig, role: Role,
                  platform: Platform) -> Optional[Plan]:
    """The plan the same rules make (make_plan's sections) on a machine that has what the
    profile asks for (its GPUs, a CUDA Mooncake build): what the build, CUDA and NVLink checks
    look for when this machine is refused. None when no machine could run the profile."""
    declared = (e.prefill_gpus or []) + (e.decode_gpus or [])
    gpus = max(platform.cuda_devices, e.prefill_ranks + e.decode_procs, max(declared, default=0) + 1)
    try:
        return make_plan(mem_pool, transport, e, role,
                         dataclasses.replace(platform, cuda_devices=gpus, mooncake_cuda=True, env={},
                                             mps_control=platform.mps_control or MPS_CONTROL))
    except ConfigError:
        return None


# ---------------------------------------------------------------------------------------------
# 1. The Mooncake wheel

NVLINK_MISSING_MARKER = b"requires -DUSE_INTRA_NVLINK"


@dataclass(frozen=True)
class MooncakeProbe:
    distribution: Optional[tuple[str, str]]  # (pip name, version)
    import_error: Optional[str]  # last line of the failed `import mooncake.engine`, or None
    cuda_build: bool  # platform.mooncake_has_cuda()
    engine_so: Optional[str]  # path of mooncake/engine*.so searched
    intra_nvlink_built: Optional[bool]  # None: no engine .so found or readable


def intra_nvlink_built(so_paths: Sequence[Path]) -> tuple[Optional[str], Optional[bool]]:
    """Search the engine .so for "requires -DUSE_INTRA_NVLINK": Mooncake compiles that error
    message ("Protocol 'nvlink_intra' requires -DUSE_INTRA_NVLINK=ON") only into builds made
    WITHOUT the flag. Returns (path searched, built-with-flag), (None, None) if none is readable."""
    for path in so_paths:
        try:
            data = Path(path).read_bytes()
        except OSError:
            continue
        return str(path), NVLINK_MISSING_MARKER not in data
    return None, None


def probe_mooncake() -> MooncakeProbe:
    import importlib.util

    from orchestrator.profile.platform import mooncake_distribution, mooncake_has_cuda

    dist = mooncake_distribution()
    # A subprocess: a wheel that cannot load its libraries must not take the doctor down.
    import_error = None
    try:
        proc = subprocess.run([sys.executable, "-c", "import mooncake.engine"],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        import_error = "the import did not finish within 120 s"
    else:
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            import_error = lines[-1].strip() if lines else f"exit code {proc.returncode}"
    try:
        spec = importlib.util.find_spec("mooncake")
        dirs = list(spec.submodule_search_locations or []) if spec else []
    except (ImportError, ValueError):
        dirs = []
    so_paths = sorted(p for d in dirs for p in Path(d).glob("engine*.so"))
    try:
        cuda_build = mooncake_has_cuda()
    except Exception:  # noqa: BLE001 - find_spec imports the package, which may fail
        cuda_build = False
    so_path, built = intra_nvlink_built(so_paths)
    return MooncakeProbe(dist, import_error, cuda_build, so_path, built)


def check_mooncake(probe: MooncakeProbe, uses_engine: bool, wants_nvlink: bool) -> Check:
    findings: list[tuple[CheckStatus, str]] = []
    needed = CheckStatus.FAIL if uses_engine else CheckStatus.WARN
    role = ("the plan sends aux by Mooncake batch writes" if uses_engine
            else "the plan sends aux over the ZMQ tcp route and starts no engine")
    if probe.distribution is None and not probe.import_error:
        findings.append((CheckStatus.WARN, "mooncake imports but no known wheel is installed (a source "
                                      "build?): its build flags are read from its engine .so."))
    elif probe.distribution is None:
        findings.append((needed, "No Mooncake wheel is installed (looked for mooncake-transfer-engine, "
                         "mooncake-transfer-engine-cuda13 and -non-cuda): `make setup`, or pip install "
                         "mooncake-transfer-engine-non-cuda on a CPU box, -cuda13 with CUDA 13."))
    else:
        name, version = probe.distribution
        findings.append((CheckStatus.OK, f"{name} {version}."))
    if probe.import_error:
        fix = ("install the library it links: `apt-get install -y libibverbs1`"
               if "libibverbs" in probe.import_error
               else "reinstall the wheel that matches this machine (CUDA 12: mooncake-transfer-engine, "
                    "CUDA 13: -cuda13, no GPU: -non-cuda)")
        findings.append((needed, f"`import mooncake.engine` fails ({probe.import_error}); {role}: {fix}."))
    elif probe.distribution is not None:
        findings.append((CheckStatus.OK, "`import mooncake.engine` works."))
    findings.append((CheckStatus.OK, "CUDA build (ships mooncake.allocator)." if probe.cuda_build
                     else "Not a CUDA build (no mooncake.allocator): TCP/RDMA transports only."))
    marker = NVLINK_MISSING_MARKER.decode()
    why = f"\"{marker}\", an error Mooncake compiles in only without -DUSE_INTRA_NVLINK=ON"
    if probe.intra_nvlink_built is None:
        findings.append((CheckStatus.WARN if wants_nvlink else CheckStatus.OK,
                         "No readable mooncake/engine*.so: cannot tell whether intra-node NVLink is "
                         "built in."))
    elif probe.intra_nvlink_built:
        findings.append((CheckStatus.OK, f"Intra-node NVLink built in: {probe.engine_so} lacks {why}."))
    else:
        findings.append((CheckStatus.OK, f"No intra-node NVLink: {probe.engine_so} contains {why}."))
    if wants_nvlink:
        if not probe.cuda_build or probe.intra_nvlink_built is False:
            findings.append((CheckStatus.FAIL,
                             "The profile needs the nvlink_intra transport, which this build lacks: "
                             "install mooncake-transfer-engine-cuda13 (CUDA 13) or "
                             "mooncake-transfer-engine (CUDA 12) on a GPU machine, or set "
                             "transport.fallback=degrade to run on host buffers over TCP."))
        else:
            findings.append((CheckStatus.OK, "The profile's nvlink_intra transport is built in."))
    elif uses_engine:
        findings.append((CheckStatus.OK, "The profile's engine transport needs no special build flag."))
    return _verdict("mooncake", findings)


# ---------------------------------------------------------------------------------------------
# 2. The plan


def check_plan(plan: Optional[Plan], error: Optional[ConfigError]) -> Check:
    if plan is None:
        return Check("plan", CheckStatus.FAIL, f"The profile cannot run here: {error}")
    text = (f"mem_pool={plan.mem_pool.value}: buffers on {plan.buffer_device.value}, route "
            f"{plan.route.value} ({plan.route_reason.value}), declared transport "
            f"{plan.declared_transport}, fallback={plan.fallback.value}")
    if plan.prefill_gpus is not None:
        text += f", GPUs prefill {list(plan.prefill_gpus)} / decode {list(plan.decode_gpus or ())}"
    findings = [(CheckStatus.OK, text + ".")]
    for event in plan.events:
        findings.append((CheckStatus.WARN, f"Degraded ({event.reason.value}): {event.detail}; the run "
                                      "logs a fallback event and its numbers are TCP numbers."))
    return _verdict("plan", findings)


# ---------------------------------------------------------------------------------------------
# 3. CUDA and peer access


@dataclass(frozen=True)
class CudaProbe:
    device_count: int = 0
    names: tuple[str, ...] = ()
    peer_access: Optional[bool] = None  # can_device_access_peer(prefill, decode), when asked
    error: Optional[str] = None


def probe_cuda(prefill_gpu: Optional[int], decode_gpu: Optional[int]) -> CudaProbe:
    try:
        import torch

        if not torch.cuda.is_available():
            return CudaProbe()
        count = torch.cuda.device_count()
        names = tuple(torch.cuda.get_device_name(i) for i in range(count))
        peer = None
        if (prefill_gpu is not None and decode_gpu is not None and prefill_gpu != decode_gpu
                and max(prefill_gpu, decode_gpu) < count):
            peer = bool(torch.cuda.can_device_access_peer(prefill_gpu, decode_gpu))
        return CudaProbe(count, names, peer)
    except Exception as exc:  # noqa: BLE001 - a broken driver is a finding, not a crash
        return CudaProbe(error=f"{type(exc).__name__}: {exc}")


def check_cuda(device: Device, prefill_gpu: Optional[int], decode_gpu: Optional[int],
               probe: Optional[CudaProbe]) -> Check:
    if device is not Device.cuda:
        return Check("cuda", CheckStatus.OK, f"Not needed: the buffers live on {device.value}.")
    if probe is None or probe.error:
        why = probe.error if probe and probe.error else "not probed"
        return Check("cuda", CheckStatus.FAIL, f"Buffers are planned on CUDA but torch's CUDA state could "
                                          f"not be read ({why}): check the driver and nvidia-smi.")
    if probe.device_count == 0:
        return Check("cuda", CheckStatus.FAIL,
                     "Buffers are planned on CUDA but torch sees no CUDA device: run on a GPU machine "
                     "with a CUDA build of torch, or pick mem_pool=NONE (or transport.fallback=degrade).")
    devices = ", ".join(f"{i}: {n}" for i, n in enumerate(probe.names)) or "?"
    findings: list[tuple[CheckStatus, str]] = [
        (CheckStatus.OK, f"{probe.device_count} CUDA device(s) ({devices}).")]
    for key, idx in (("endpoints.prefill_gpus", prefill_gpu), ("endpoints.decode_gpus", decode_gpu)):
        if idx is not None and idx >= probe.device_count:
            findings.append((CheckStatus.FAIL, f"{key}={idx} does not exist here "
                                          f"(devices 0..{probe.device_count - 1})."))
    if prefill_gpu is not None and prefill_gpu == decode_gpu:
        findings.append((CheckStatus.OK, f"Both endpoints on GPU {prefill_gpu}: no peer access needed "
                                    "(CUDA IPC within one device)."))
    elif probe.peer_access is True:
        findings.append((CheckStatus.OK, f"GPU {prefill_gpu} can access GPU {decode_gpu} as a peer "
                                    "(torch.cuda.can_device_access_peer)."))
    elif probe.peer_access is False:
        findings.append((CheckStatus.WARN, f"GPU {prefill_gpu} cannot access GPU {decode_gpu} as a peer: "
                                      "copies between them will not go over NVLink P2P; check "
                                      "`nvidia-smi topo -m` or pick GPUs joined by NVLink "
                                      "(endpoints.prefill_gpus / endpoints.decode_gpus)."))
    return _verdict("cuda", findings)


# ---------------------------------------------------------------------------------------------
# 4. MC_* presence traps in this shell


def check_mc_env(env: Mapping[str, str], wants_nvlink: bool, plan_env: Mapping[str, Optional[str]],
                 intra_profile: bool = False) -> Check:
    """The shell's MC_* variables against the plan. WARN only: this tool's own runs set or
    unset every managed name from plan.mc_env; a serving engine started from this shell
    does not."""
    findings: list[tuple[CheckStatus, str]] = []
    off = sorted(k for k, v in env.items() if k.startswith("MC_") and v.strip().lower() in OFF_LOOKING)
    if off:
        shown = ", ".join(f"{k}={env[k]!r}" for k in off)
        findings.append((CheckStatus.WARN, f"{shown} set in this shell: Mooncake only tests presence, so "
                                      "this still turns the feature ON; `unset` it instead."))
    if wants_nvlink and "MC_INTRANODE_NVLINK" not in env:
        findings.append((CheckStatus.WARN, "MC_INTRANODE_NVLINK is not set in this shell: a serving engine "
                                      "started from here would silently run on TCP (protocol "
                                      "nvlink_intra alone does not select NVLink); this tool's runs "
                                      "set it from the plan; for SGLang: "
                                      "eval \"$(python -m orchestrator.export_env ...)\"."))
    if wants_nvlink and "MC_FORCE_TCP" in env:
        findings.append((CheckStatus.WARN, "MC_FORCE_TCP is set in this shell while the plan wants "
                                      "nvlink_intra: a serving engine started from here would run on "
                                      "TCP; this tool's runs unset it; `unset MC_FORCE_TCP` or use "
                                      "python -m orchestrator.export_env."))
    if not findings:
        differ = sorted(k for k, v in plan_env.items() if env.get(k) != v)
        text = "No MC_* presence traps in this shell."
        if intra_profile and not wants_nvlink:
            text += " (The plan does not use nvlink_intra, so MC_INTRANODE_NVLINK is not expected.)"
        if differ:
            text += (f" The shell differs from the plan in {', '.join(differ)}; this tool's runs "
                     "set them, a serving engine needs python -m orchestrator.export_env.")
        findings.append((CheckStatus.OK, text))
    return _verdict("mc-env", findings)


# ---------------------------------------------------------------------------------------------
# 5. PyTorch expandable segments

def check_alloc_conf(env: Mapping[str, str], wants_nvlink: bool) -> Check:
    on = expandable_segments(env)
    if not on:
        return Check("alloc-conf", CheckStatus.OK, "PyTorch expandable segments are off: CUDA tensors are "
                                              "cudaMalloc'd and have CUDA IPC handles.")
    shown = ", ".join(f"{n}={env[n]}" for n in on)
    if wants_nvlink:
        return Check("alloc-conf", CheckStatus.FAIL,
                     f"{shown} with an nvlink_intra plan: expandable-segment memory comes from "
                     "cuMemCreate, has no CUDA IPC handle and fails to register with Mooncake's "
                     "NVLink transport (the plan check refuses it); remove expandable_segments:True.")
    return Check("alloc-conf", CheckStatus.OK, f"{shown} is set; harmless here (the plan does not use "
                                          "nvlink_intra), but it breaks INTRA_NODE_NVLINK profiles.")


# ---------------------------------------------------------------------------------------------
# 6. Mooncake RPC ports

NARROW_RANGE = 100


def check_rpc_ports(env: Mapping[str, str], host: str,
                    is_free: Callable[[str, int], bool] = port_is_free,
                    sample: int = 64, rng: Optional[random.Random] = None,
                    uses_engine: bool = True) -> Check:
    """Probe `sample` random ports of the range plus both ends (all of a small range).
    A plan that starts no engine (tcp route) gets at most a WARN: the run does not need them."""
    check = _rpc_ports(env, host, is_free, sample, rng)
    if uses_engine or check.status is CheckStatus.OK:
        return check
    return Check(check.name, CheckStatus.WARN, "The plan starts no Mooncake engine (tcp route), so this "
                                          "run does not need the port, but a serving engine would: "
                                          + check.detail)


def _rpc_ports(env: Mapping[str, str], host: str, is_free: Callable[[str, int], bool],
               sample: int, rng: Optional[random.Random]) -> Check:
    name = "rpc-ports"
    try:
        lo, hi = rpc_port_range(env)
    except ValueError as exc:
        return Check(name, CheckStatus.FAIL, f"{exc}: Mooncake would pick its RPC port from a bogus range "
                                        "(and segfaults at initialize when none is free); unset "
                                        "MC_MIN_RPC_PORT / MC_MAX_RPC_PORT or fix them.")
    where = ("from MC_MIN_RPC_PORT/MC_MAX_RPC_PORT" if "MC_MIN_RPC_PORT" in env or "MC_MAX_RPC_PORT" in env
             else "Mooncake's default")
    if hi < lo:
        return Check(name, CheckStatus.FAIL, f"RPC port range {lo}..{hi} ({where}) is empty: Mooncake picks "
                                        "its RPC port there and segfaults at initialize when it finds "
                                        "none; unset MC_MIN_RPC_PORT / MC_MAX_RPC_PORT or make min <= max.")
    width = hi - lo + 1
    if width <= sample + 2:
        ports = list(range(lo, hi + 1))
    else:
        rng = rng or random.Random()
        ports = sorted({lo, hi, *rng.sample(range(lo + 1, hi), sample)})
    free = sum(1 for p in ports if is_free(host, p))
    text = (f"RPC port range {lo}..{hi} ({where}, {width} ports): {free} of {len(ports)} probed "
            f"ports bind on 0.0.0.0 and {host}.")
    if free == 0:
        return Check(name, CheckStatus.FAIL, text + " None is free: Mooncake would segfault at initialize; "
                                               "free some ports or widen the range.")
    if width < NARROW_RANGE:
        return Check(name, CheckStatus.WARN, text + f" The range is narrower than {NARROW_RANGE} ports: each "
                                               "engine takes one at random, and initialize segfaults "
                                               "when none is left; widen it or unset the variables.")
    return Check(name, CheckStatus.OK, text)


# ---------------------------------------------------------------------------------------------
# 7. The declared host


def bind_error(host: str) -> Optional[str]:
    """None if a TCP socket can bind host:0, else the error (e.g. the address is not local)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_host(host: str, try_bind: Callable[[str], Optional[str]] = bind_error,
               authenticated: bool = True, uses_engine: bool = False) -> Check:
    """Loopback: OK. Otherwise the address must be this machine's (a bind to host:0 works),
    and then the planes are reachable from the network: WARN. (Whether the profile may run
    at all, secret included, is the plan check's: the rule book.)"""
    name = "host"
    findings: list[tuple[CheckStatus, str]] = []
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        return Check(name, CheckStatus.FAIL, f"transport.host={host!r} is not an IPv4 address.")
    if is_loopback(host):
        findings.append((CheckStatus.OK, f"transport.host={host}: the ZMQ data and control planes bind "
                                    "loopback only (both endpoints on this machine)."))
    elif (err := try_bind(host)) is not None:
        findings.append((CheckStatus.FAIL, f"transport.host={host} is not an address of this machine "
                                      f"(bind failed: {err}); use 127.0.0.1 or an address from "
                                      "`ip -4 addr`."))
    else:
        exposed = ("binds every interface, and 0.0.0.0 is no address a peer can dial"
                   if addr.is_unspecified else "is a local non-loopback address")
        auth = ("every message carries a MAC and every row a keyed digest (transport.secret_env); "
                "nothing is encrypted")
        findings.append((CheckStatus.WARN, f"transport.host={host} {exposed}: the data and control planes "
                                      f"are reachable from the network; {auth}; firewall it, or use "
                                      "127.0.0.1 when both endpoints are on this machine."))
    if uses_engine:
        findings.append((CheckStatus.WARN, "Mooncake itself binds its handshake (RPC) and TCP-transport "
                                      "listeners on all interfaces whatever host it is given "
                                      "(seen with ss on 0.3.13/0.3.14): firewall ports "
                                      "MC_MIN_RPC_PORT..MC_MAX_RPC_PORT or run in a network "
                                      "namespace; each run lists them in results.json."))
    return _verdict(name, findings)


# ---------------------------------------------------------------------------------------------
# Running them


@dataclass
class Report:
    overrides: list[str]
    checks: list[Check]
    plan: Optional[Plan] = None

    @property
    def ok(self) -> bool:
        return all(c.status is not CheckStatus.FAIL for c in self.checks)

    def as_dict(self) -> dict:
        return {"profile": overrides_dict(self.overrides), "ok": self.ok,
                "checks": [c.as_dict() for c in self.checks],
                "plan": self.plan.as_dict() if self.plan else None}

    def text(self) -> str:
        lines = [c.line() for c in self.checks]
        failed = [c.name for c in self.checks if c.status is CheckStatus.FAIL]
        label = profile_label(self.overrides)
        if failed:
            lines.append(f"=> {label}: cannot run as declared here ({len(failed)} FAIL: {', '.join(failed)})")
        else:
            lines.append(f"=> {label}: can run as declared here")
        return "\n".join(lines)


def run_checks(spec: DoctorSpec, overrides: Sequence[str],
               env: Optional[Mapping[str, str]] = None, peer_address: Optional[str] = None) -> Report:
    """The doctor's checks of the profile `spec` describes (job.check.doctor_spec) on this machine."""
    from orchestrator.profile.platform import detect

    platform = detect()
    if env is not None:
        platform = dataclasses.replace(platform, env=dict(env))
    env = platform.env
    plan: Optional[Plan] = None
    error: Optional[ConfigError] = None
    try:
        plan = spec.check(platform)  # the rule book, exactly as the run applies it
    except ConfigError as exc:
        error = exc
    intent = plan or intended_plan(spec.mem_pool, spec.transport, spec.endpoints, spec.role, platform)
    device = intent.buffer_device if intent else Device.cpu
    uses_engine = intent is not None and intent.route is Route.engine
    wants_nvlink = intent is not None and intent.engine_transport is EngineTransport.nvlink_intra
    prefill_gpu = intent.prefill_gpus[0] if intent and intent.prefill_gpus else None
    decode_gpu = intent.decode_gpus[0] if intent and intent.decode_gpus else None
    cuda = probe_cuda(prefill_gpu, decode_gpu) if device is Device.cuda else None
    host = spec.transport.host if spec.transport.host != "auto" else "0.0.0.0"
    checks = [
        check_mooncake(probe_mooncake(), uses_engine, wants_nvlink),
        check_plan(plan, error),
        check_cuda(device, prefill_gpu, decode_gpu, cuda),
        check_mc_env(env, wants_nvlink, plan.mc_env if plan else {},
                     intra_profile=spec.mem_pool.type is MemPoolType.INTRA_NODE_NVLINK),
        check_alloc_conf(env, wants_nvlink),
        check_rpc_ports(env, host, uses_engine=uses_engine),
        check_host(host, uses_engine=uses_engine),
        check_address(env, peer_address),
    ]
    return Report(list(overrides), checks, plan)


def check_layouts(mine: tuple[LayoutConfig, BuffersConfig], peer: tuple[LayoutConfig, BuffersConfig],
                  peer_label: str) -> Check:
    """Two profiles (a prefill's and a decode's: each its layout and buffers sections) must
    give the same aux layout: field names, dtypes and item lengths, in order. SGLang itself
    never compares them."""
    from orchestrator.profile.layout import first_difference, profile_layout

    (layout, buffers), (peer_layout, peer_buffers) = mine, peer
    fields = profile_layout(buffers, layout)
    diff = first_difference(fields, profile_layout(peer_buffers, peer_layout))
    if diff is None:
        return Check("layout", CheckStatus.OK,
                     f"{layout.name} and the peer's ({peer_label or 'defaults'}: "
                     f"{peer_layout.name}) give the same {len(fields)} fields")
    return Check("layout", CheckStatus.FAIL,
                 f"the peer's profile ({peer_label}) gives another aux layout: {diff}; a run "
                 "between them is refused at bootstrap, and SGLang would corrupt memory silently")


# ---------------------------------------------------------------------------------------------
# A deployment's environment (--env-file / --manifest)


def _read_inputs(env_files: Sequence[str], manifests: Sequence[str]) -> list[Environment]:
    from orchestrator.preflight import deployment as dep

    environments: list[Environment] = []
    try:
        for name in env_files:
            if name == "-":
                environments.append(dep.env_file_environment(dep.parse_env_output(sys.stdin.read()),
                                                             "stdin (env output)"))
            else:
                text = Path(name).read_text()
                environments.append(dep.env_file_environment(dep.parse_dotenv(text, name), name))
        for name in manifests:
            found = dep.parse_manifest(Path(name).read_text(), name)
            if not any(dep.serving(e) for e in found):
                raise dep.InputError(f"{name}: no container runs SGLang or sets an SGLang / Mooncake "
                                     f"variable ({len(found)} container(s) looked at)")
            environments += found
    except OSError as exc:
        error_exit(f"{exc.filename}: {exc.strerror}")
    except UnicodeDecodeError as exc:
        error_exit(f"not a text file ({exc.reason})")
    except dep.InputError as exc:
        error_exit(str(exc))
    return environments


def _wheel() -> Wheel:
    from orchestrator.preflight.deployment import Wheel

    probe = probe_mooncake()
    name = " ".join(probe.distribution) if probe.distribution else "no known Mooncake wheel"
    # a build without CUDA has no nvlink_intra, whatever its engine .so says
    return Wheel(name, probe.intra_nvlink_built if probe.cuda_build else False)


def env_report(env_files: Sequence[str], manifests: Sequence[str],
               extra: Sequence[str]) -> tuple[list[Reading], list[Environment], Crossed]:
    from orchestrator.preflight import deployment as dep

    environments = _read_inputs(env_files, manifests)
    wheel = _wheel()
    readings: list[Reading] = []
    skipped: list[Environment] = []
    for e in environments:
        if dep.serving(e):
            readings.append(dep.judge(e, wheel, load_profile, extra))
        else:
            skipped.append(e)
    crossed = [(a, b, dep.cross_check(a, b)) for a, b in dep.pairs(readings)]
    return readings, skipped, crossed


def _title(reading: Reading) -> str:
    role = reading.environment.role
    return reading.environment.label + (f" ({role.value})" if role else "")


def env_text(readings: Sequence[Reading], skipped: Sequence[Environment], crossed: Crossed,
             extra: Sequence[str]) -> str:
    lines = []
    for r in readings:
        lines.append(f"== {_title(r)}")
        if r.overrides is not None:
            lines.append(f"profile: python -m orchestrator {shlex.join([*extra, *r.profile])}")
        lines.append(f"plan:    {plan_text(r)}")
        lines.append(f"address: {r.address}")
        lines += [f.line() for f in r.findings]
    for e in skipped:
        lines.append(f"== {e.label}: skipped (no SGLang or Mooncake variable, no sglang in its command)")
    if len(readings) > 2 and not crossed:
        lines.append(f"== {len(readings)} environments, none of them named prefill or decode: not "
                     "compared (give `--disaggregation-mode` in the command, or put prefill / decode "
                     "in the container or file names)")
    for a, b, findings in crossed:
        lines.append(f"== prefill {_title(a)} <-> decode {_title(b)}")
        lines += [f.line() for f in findings]
    every = [f for r in readings for f in r.findings] + [f for _, _, fs in crossed for f in fs]
    fails = sum(f.level.value == "FAIL" for f in every)
    warns = sum(f.level.value == "WARN" for f in every)
    verdict = "would not run as meant" if fails else "no FAIL"
    lines.append(f"=> {len(readings)} environment(s), {len(crossed)} prefill/decode pair(s): "
                 f"{fails} FAIL, {warns} WARN: {verdict}")
    return "\n".join(lines)


def plan_text(reading: Reading) -> str:
    from orchestrator.preflight.deployment import plan_line

    return plan_line(reading)


def env_json(readings: Sequence[Reading], skipped: Sequence[Environment], crossed: Crossed,
             extra: Sequence[str]) -> dict[str, Any]:
    def one(r: Reading) -> dict[str, Any]:
        return {"label": r.environment.label,
                "role": r.environment.role.value if r.environment.role else None,
                "profile": [*extra, *r.profile] if r.overrides is not None else None,
                "plan": r.plan.as_dict() if r.plan else None, "refusal": r.refusal,
                "address": r.address,
                "unknown": [{"name": n, "from": w} for n, w in r.environment.unknown],
                "findings": [f.as_dict() for f in r.findings]}

    pairs = [{"prefill": a.environment.label, "decode": b.environment.label,
              "findings": [f.as_dict() for f in fs]} for a, b, fs in crossed]
    every = [f for r in readings for f in r.findings] + [f for _, _, fs in crossed for f in fs]
    return {"ok": not any(f.level.value == "FAIL" for f in every),
            "environments": [one(r) for r in readings], "pairs": pairs,
            "skipped": [e.label for e in skipped]}


def run_implied(readings: Sequence[Reading], extra: Sequence[str]) -> int:
    """python -m orchestrator with the implied profile, here; its exit code."""
    profiles = {tuple([*extra, *r.profile]) for r in readings}
    if len(profiles) != 1:
        error_exit("--run: the environments imply different profiles ("
                   + " | ".join(shlex.join(p) for p in sorted(profiles))
                   + "); pass the one to run")
    (profile,) = profiles
    child = dict(os.environ)
    for var in ALLOC_CONF_VARS:  # the deployment's allocator settings, as the rule book saw them
        child.pop(var, None)
        value = readings[0].environment.env.get(var)
        if value is not None:
            child[var] = value
    print(f"$ python -m orchestrator {shlex.join(profile)}", flush=True)
    try:
        return subprocess.run([sys.executable, "-m", "orchestrator", *profile], env=child).returncode
    except KeyboardInterrupt as exc:
        return failure.ending(exc).code


def env_main(args: argparse.Namespace) -> int:
    from orchestrator.preflight.deployment import Level
    from orchestrator.preflight.serving import profile_from_env

    extra = list(args.overrides)
    implied = set(profile_from_env({}))
    for item in extra:
        key = item.lstrip("+~").split("=", 1)[0]
        if key in implied:
            error_exit(f"{item}: {key} is what the environment decides (the implied profile sets "
                       f"it); change the environment instead, or drop --env-file/--manifest")
    if extra:
        try:
            load_profile(extra)
        except ProfileError as exc:
            error_exit(str(exc))
    readings, skipped, crossed = env_report(args.env_file, args.manifest, extra)
    if args.json:
        print(json.dumps(env_json(readings, skipped, crossed, extra), indent=2))
    else:
        print(env_text(readings, skipped, crossed, extra), flush=True)
    failed = any(f.level is Level.FAIL for r in readings for f in r.findings) or any(
        f.level is Level.FAIL for _, _, fs in crossed for f in fs)
    if not args.run:
        return 1 if failed else 0
    if failed:
        print("not run: fix the FAILs above first", file=sys.stderr, flush=True)
        return 1
    return run_implied(readings, extra)


def check_process_space(transport: Optional[EngineTransport], peer_pid_ns: Optional[str],
                        mine: Optional[tuple[str, str]] = None) -> Check:
    """nvlink_intra needs both sides in one PID namespace (plan.same_process_space_rule, the
    rule the bootstrap applies): this side's namespace, and the peer's when given."""
    from orchestrator.profile.plan import same_process_space_rule

    if mine is None:
        from orchestrator.profile.platform import boot_id, pid_namespace

        mine = (pid_namespace(), boot_id())
    ns = mine[0] or "unknown"
    if transport is not EngineTransport.nvlink_intra:
        return Check("pid-ns", CheckStatus.OK, f"This side's PID namespace is {ns}; the engine transport is not "
                     "nvlink_intra, so the peer's may differ.")
    if peer_pid_ns is None:
        return Check("pid-ns", CheckStatus.WARN,
                     f"This side's PID namespace is {ns}: nvlink_intra (CUDA IPC) needs the peer in the same "
                     "one (--pid=host, Kubernetes hostPID: true); pass the peer's as --peer-pid-ns (its "
                     "doctor prints it) to compare now. A run compares them at bootstrap.")
    why = same_process_space_rule(transport, mine, (peer_pid_ns, ""))
    if why is not None:
        return Check("pid-ns", CheckStatus.FAIL, why + "; a run between them is refused at bootstrap")
    return Check("pid-ns", CheckStatus.OK, f"Both sides are in PID namespace {ns}: nvlink_intra's CUDA IPC can map "
                 "the peer's memory.")


def check_address(env: Mapping[str, str], peer_address: Optional[str] = None,
                  host: Optional[Host] = None) -> Check:
    """The address this side would advertise under SGLang 0.5.23's rule (SGLANG_HOST_IP /
    HOST_IP, SGLANG_LOCAL_IP_NIC, the default route, the hostname), the step that chose it, and
    what a peer would trip on (orchestrator.profile.address). `peer_address`: the address the
    other side advertises (its doctor prints it)."""
    from orchestrator.profile import address

    host = host if host is not None else address.probe_host(env)
    adv = address.advertise(host)
    status, detail = address.summary(adv, address.judge(adv, host, peer_address))
    if peer_address:
        detail += f" (peer: {peer_address})"
    return Check("address", CheckStatus(status), detail)


def check_versions(mine: Versions, peer: Optional[Versions] = None, peer_label: str = "") -> Check:
    """This side's versions, and (with the peer's) the skew: FAIL for a known
    incompatibility, WARN for any other difference (orchestrator.profile.versions)."""
    from orchestrator.profile import versions

    text = f"this side: {versions.as_text(mine)}"
    if peer is None:
        return Check("versions", CheckStatus.OK, text + " (pass the other side's line as --peer-versions "
                                                   "to compare; a split run compares them at bootstrap)")
    text += f"; the peer{peer_label}: {versions.as_text(peer)}"
    found = versions.skew(mine, peer)
    if not found:
        return Check("versions", CheckStatus.OK, text + "; the same")
    status = CheckStatus.FAIL if any(f for f, _ in found) else CheckStatus.WARN
    return Check("versions", status, text + ". " + " ".join(t + "." for _, t in found))


def build_parser() -> argparse.ArgumentParser:
    """The command line (main's; tests/test_docs.py parses every documented command with it)."""
    parser = profile_parser(
        "python -m orchestrator.doctor",
        "Check whether this machine can run a profile as declared. Exit 0: no FAIL; "
        "1: at least one FAIL; 2: the profile itself is broken.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--peer", metavar="OVERRIDES", default=None,
                        help="the other side's profile, one quoted string (e.g. --peer "
                             "'layout=sglang_pre_0_5_23'): its aux layout must match this one's")
    parser.add_argument("--env-file", action="append", default=[], metavar="FILE",
                        help="judge a deployment's env: a dotenv file, or - for `env` output on "
                             "stdin (twice: a prefill's and a decode's); overrides are added first")
    parser.add_argument("--manifest", action="append", default=[], metavar="FILE.yaml",
                        help="judge every container's env: list of a Kubernetes manifest (Pod, "
                             "Deployment, StatefulSet, LeaderWorkerSet, ...)")
    parser.add_argument("--run", action="store_true",
                        help="with --env-file/--manifest: then run the implied profile here")
    parser.add_argument("--peer-address", metavar="ADDR", default=None,
                        help="the address the other side advertises (its doctor's `address` line): "
                             "this side's is judged against its subnet")
    parser.add_argument("--peer-versions", metavar="LINE", default=None,
                        help="the other side's versions as its doctor prints them (the `versions` "
                             "line after 'this side: '): a skew WARNs, a known incompatibility FAILs")
    parser.add_argument("--peer-pid-ns", metavar="ID", default=None,
                        help="the other side's PID namespace as its doctor prints it (pid:[N]): under "
                             "nvlink_intra both must be the same")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.env_file or args.manifest:
        if args.peer is not None:
            error_exit("--peer compares two profiles; with --env-file/--manifest give both sides' "
                       "environments instead")
        return env_main(args)
    if args.run:
        error_exit("--run needs --env-file or --manifest (it runs the profile they imply)")
    from orchestrator.profile import versions

    try:
        cfg = load_profile(args.overrides)
        peer = load_profile(shlex.split(args.peer)) if args.peer is not None else None
        peer_versions = versions.from_text(args.peer_versions) if args.peer_versions else None
    except ProfileError as exc:
        error_exit(str(exc))
    except ValueError as exc:
        error_exit(f"--peer-versions: {exc}")
    if args.peer_address is not None:
        try:
            ipaddress.ip_address(args.peer_address)
        except ValueError:
            error_exit(f"--peer-address={args.peer_address} is not an IP address")
    report = run_checks(doctor_spec(cfg), args.overrides, peer_address=args.peer_address)
    mine = versions.local(cfg.layout.name)
    label = ""
    if peer_versions is None and peer is not None:
        peer_versions, label = versions.local(peer.layout.name), " (its profile, on this machine)"
    report.checks.append(check_versions(mine, peer_versions, label))
    if peer is not None:
        report.checks.append(check_layouts((cfg.layout, cfg.buffers), (peer.layout, peer.buffers), args.peer))
    from orchestrator.profile.platform import detect

    intent = report.plan or intended_plan(cfg.mem_pool, cfg.transport, cfg.endpoints, cfg.role, detect())
    transport = intent.engine_transport if intent else None
    if peer is not None or args.peer_pid_ns is not None or transport is EngineTransport.nvlink_intra:
        report.checks.append(check_process_space(transport, args.peer_pid_ns))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
