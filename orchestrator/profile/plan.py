"""The plan: every rule that decides where aux buffers live, which route a request takes,
and which environment the Mooncake engine must see. Pure: no I/O, no torch, no env mutation.

This module is the one place that answers "why did this request go over TCP?". Each rule is
a small function of enums returning a value and a reason, so every combination is a one-line
unit test. :func:`make_plan` composes them, refuses combinations that cannot work (with a
message naming the key, the value and what is allowed) and returns a :class:`Plan` that the
rest of the program applies and logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping, Optional, Sequence

from orchestrator.profile.config import (
    SPIN_MIN_CORES,
    CompletionSetting,
    ConfigError,
    EndpointsConfig,
    EngineTransportSetting,
    FallbackPolicy,
    MemPoolConfig,
    MemPoolType,
    MooncakeConfig,
    MpsMode,
    Role,
    RouteSetting,
    TransportConfig,
)
from orchestrator.profile.sharing import GpuSharing, processes_on_gpus, sharing_rule


class Device(Enum):
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


class Route(Enum):
    """How send_aux moves one request's aux record."""

    tcp = "tcp"  # ZMQ AUX_DATA frames, one per field (host memory only)
    engine = "engine"  # one Mooncake batch write, one block per field


class EngineTransport(Enum):
    """The Mooncake transport the engine route runs on (chosen by MC_* presence at init)."""

    tcp = "tcp"
    rdma = "rdma"
    nvlink_intra = "nvlink_intra"


class Reason(Enum):
    """Stable reason codes for routing and placement decisions (logged as their value)."""

    pool_nvlink_sends_over_tcp = "pool_nvlink_sends_over_tcp"
    route_forced_tcp = "route_forced_tcp"
    route_forced_engine = "route_forced_engine"
    engine_default = "engine_default"
    degraded_no_cuda = "degraded_no_cuda"
    degraded_no_cuda_mooncake = "degraded_no_cuda_mooncake"


@dataclass(frozen=True)
class Platform:
    """What the machine offers; detected by orchestrator.profile.platform, passed in here as data."""

    cuda_devices: int = 0
    npu: bool = False
    cpu_count: int = 8  # cores this process may use (affinity and cgroup quota)
    mooncake_cuda: bool = False  # the installed Mooncake wheel has the CUDA transports
    rdma_devices: tuple[str, ...] = ()  # /sys/class/infiniband entries (HCAs the engine can open)
    env: Mapping[str, str] = field(default_factory=dict)  # snapshot of os.environ
    host_mem_bytes: Optional[int] = None  # MemAvailable (None: not known, not checked)
    gpu_mem_bytes: tuple[int, ...] = ()  # each CUDA device's total memory (empty: not checked)
    mps_control: Optional[str] = None  # nvidia-cuda-mps-control's path (None: not on PATH)
    mps_pipe: Optional[str] = None  # the pipe dir of an MPS daemon already running (None: none)

    @property
    def cuda(self) -> bool:
        return self.cuda_devices > 0


# Every MC_* variable a run depends on. The engine tests PRESENCE only (MC_INTRANODE_NVLINK=0
# still turns NVLink on), so each one is either set or removed, never left to chance.
MANAGED_MC_VARS = (
    "MC_FORCE_TCP",
    "MC_INTRANODE_NVLINK",
    "MC_FORCE_MNNVL",
    "MC_FORCE_HCA",
    "MC_TCP_PROGRESS_TIMEOUT_SEC",
)
# Values of an MC_* variable that read as "off" (SGLang's false spellings, "off", empty), all of
# which Mooncake takes as ON: the doctor and the deployment check warn on them.
OFF_LOOKING = frozenset({"0", "false", "no", "n", "off", ""})


def buffer_device(pool: MemPoolType, platform: Platform) -> Device:
    """SGLang's device rule for MetadataBuffers.

    NPU builds keep them on the NPU. NVLINK and BAREX pools keep the aux buffers on the host
    (their custom allocators serve the KV cache; SGLang keeps aux on cpu until Mooncake's
    NVLink transport is bug-free). INTRA_NODE_NVLINK buffers are plain CUDA memory shared by
    CUDA IPC. Everything else: host.
    """
    if platform.npu:
        return Device.npu
    if pool is MemPoolType.INTRA_NODE_NVLINK:
        return Device.cuda
    return Device.cpu


def route_rule(pool: MemPoolType, setting: RouteSetting) -> tuple[Route, Reason]:
    """SGLang's send_aux rule, with exact enum identity (never substring or `in` on strings).

    NVLINK pool -> tcp; forced tcp -> tcp; otherwise the engine.
    """
    if pool is MemPoolType.NVLINK:
        return Route.tcp, Reason.pool_nvlink_sends_over_tcp
    if setting is RouteSetting.tcp:
        return Route.tcp, Reason.route_forced_tcp
    if setting is RouteSetting.engine:
        return Route.engine, Reason.route_forced_engine
    return Route.engine, Reason.engine_default


def engine_transport_rule(setting: EngineTransportSetting, device: Device) -> EngineTransport:
    """Which Mooncake transport the engine route should come up with."""
    if setting is EngineTransportSetting.auto:
        return EngineTransport.nvlink_intra if device is Device.cuda else EngineTransport.tcp
    return EngineTransport(setting.value)


def engine_env(transport: EngineTransport, tcp_progress_timeout_s: int) -> dict[str, Optional[str]]:
    """The MC_* environment that makes Mooncake pick `transport`: value to set, or None to unset.

    Covers every name in MANAGED_MC_VARS, so nothing inherited from the shell can leak in.
    """
    env: dict[str, Optional[str]] = {name: None for name in MANAGED_MC_VARS}
    env["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(tcp_progress_timeout_s)
    if transport is EngineTransport.tcp:
        env["MC_FORCE_TCP"] = "1"
    elif transport is EngineTransport.nvlink_intra:
        env["MC_INTRANODE_NVLINK"] = "1"
    return env




def completion_rule(setting: CompletionSetting, cpu_count: int) -> CompletionSetting:
    """How to wait for a batch write: spin where cores are plenty, nap where they are few."""
    if setting is CompletionSetting.auto:
        return CompletionSetting.spin if cpu_count >= SPIN_MIN_CORES else CompletionSetting.nap
    return setting


def same_process_space_rule(transport: Optional[EngineTransport], mine: tuple[str, str],
                            theirs: tuple[str, str]) -> Optional[str]:
    """Mooncake's nvlink_intra maps the peer's GPU memory by CUDA IPC, which needs both sides
    on one kernel (boot id) and in one PID namespace: two containers or pods on one node each
    have their own unless started with --pid=host (Kubernetes: hostPID: true). `mine` and
    `theirs` are (PID-namespace id, boot id) as each side sent them at bootstrap ("" when
    unknown). Returns why a run must be refused before any byte moves, or None."""
    if transport is not EngineTransport.nvlink_intra:
        return None
    (ns, boot), (peer_ns, peer_boot) = mine, theirs
    if boot and peer_boot and boot != peer_boot:
        return (f"transport nvlink_intra needs both sides on one host, and the peer runs on another "
                f"kernel (boot id {peer_boot[:8]}, this side {boot[:8]}): use "
                "transport.mooncake.transport=rdma or tcp across hosts")
    if ns and peer_ns and ns != peer_ns:
        return (f"transport nvlink_intra (CUDA IPC) needs both sides in one PID namespace: this side "
                f"is in {ns}, the peer in {peer_ns}; start both containers with --pid=host "
                "(Kubernetes: hostPID: true), or use transport.mooncake.transport=tcp")
    return None


def mooncake_protocol(transport: EngineTransport) -> str:
    """The protocol string passed to initialize (recorded; the env above is what decides)."""
    return transport.value


@dataclass(frozen=True)
class PlanEvent:
    """A placement decision taken at plan time (e.g. a fallback); logged before the run."""

    event: str
    reason: Reason
    detail: str


@dataclass(frozen=True)
class Plan:
    mem_pool: MemPoolType
    buffer_device: Device
    route: Route
    route_reason: Reason
    engine_transport: Optional[EngineTransport]  # None when no request uses the engine
    mc_env: dict[str, Optional[str]]
    protocol: Optional[str]
    prefill_gpus: Optional[tuple[int, ...]]  # one per prefill rank (None: host buffers)
    decode_gpus: Optional[tuple[int, ...]]  # one per decode process (instance-major, TP rank minor)
    fallback: FallbackPolicy
    completion: CompletionSetting = CompletionSetting.spin
    events: tuple[PlanEvent, ...] = ()
    sharing: GpuSharing = GpuSharing(MpsMode.auto)  # the processes on each GPU, and MPS for them

    @property
    def declared_transport(self) -> str:
        """What the handoffs are declared to travel over: 'zmq-tcp' or the engine transport."""
        if self.route is Route.tcp:
            return "zmq-tcp"
        assert self.engine_transport is not None
        return f"mooncake-{self.engine_transport.value}"

    def as_dict(self) -> dict:
        return {
            "mem_pool": self.mem_pool.value,
            "buffer_device": self.buffer_device.value,
            "route": self.route.value,
            "route_reason": self.route_reason.value,
            "engine_transport": self.engine_transport.value if self.engine_transport else None,
            "declared_transport": self.declared_transport,
            "mc_env": dict(self.mc_env),
            "protocol": self.protocol,
            "prefill_gpus": list(self.prefill_gpus) if self.prefill_gpus else None,
            "decode_gpus": list(self.decode_gpus) if self.decode_gpus else None,
            "fallback": self.fallback.value,
            "completion": self.completion.value,
            "gpu_sharing": self.sharing.as_dict(),
            "events": [
                {"event": e.event, "reason": e.reason.value, "detail": e.detail} for e in self.events
            ],
        }


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads both


def expandable_segments(env: Mapping[str, str]) -> list[str]:
    """The allocator variables of `env` that turn PyTorch's expandable segments on
    ("key:value,key:value", case-insensitive value as torch parses it)."""
    on = []
    for var in ALLOC_CONF_VARS:
        pairs = (item.split(":", 1) for item in env.get(var, "").split(",") if ":" in item)
        options = {k.strip(): v.strip() for k, v in pairs}
        if options.get("expandable_segments", "").lower() == "true":
            on.append(var)
    return on


def gpu_placement(prefill_ranks: int, decode_ranks: int, prefill_gpus: Optional[Sequence[int]],
                  decode_gpus: Optional[Sequence[int]], cuda_devices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Declared GPUs, or auto: prefill ranks on GPUs 0.., decode processes on the next ones,
    wrapping modulo the GPU count (4+4 ranks on 8 GPUs: prefill 0-3, decode 4-7)."""
    n = max(cuda_devices, 1)
    prefill = tuple(prefill_gpus) if prefill_gpus else tuple(i % n for i in range(prefill_ranks))
    decode = tuple(decode_gpus) if decode_gpus else tuple(
        (prefill_ranks + j) % n for j in range(decode_ranks))
    return prefill, decode


def _gpu_placement(endpoints: EndpointsConfig, platform: Platform) -> tuple[tuple[int, ...], tuple[int, ...]]:
    e, n = endpoints, platform.cuda_devices
    prefill, decode = gpu_placement(e.prefill_ranks, e.decode_procs, e.prefill_gpus, e.decode_gpus, n)
    for key, gpus in (("endpoints.prefill_gpus", prefill), ("endpoints.decode_gpus", decode)):
        if max(gpus) >= n:
            raise ConfigError(key, list(gpus), f"CUDA device indices below {n} (this machine has {n})")
    return prefill, decode


def make_plan(mem_pool: MemPoolConfig, transport: TransportConfig, endpoints: EndpointsConfig, role: Role,
              platform: Platform) -> Plan:
    """Compose the rules for one run; raise ConfigError for combinations that cannot work."""
    pool, setting, policy = mem_pool.type, transport.route, transport.fallback
    device = buffer_device(pool, platform)
    events: list[PlanEvent] = []

    if device is Device.npu:
        raise ConfigError("mem_pool.type", pool.value, "a CUDA or CPU placement (NPU builds are not supported)")

    if pool is MemPoolType.NVLINK and setting is RouteSetting.engine:
        raise ConfigError("transport.route", setting.value,
                          "auto or tcp with mem_pool=NVLINK, whose aux always goes over tcp")

    if device is Device.cuda:
        device = _cuda_or_fallback(pool, policy, platform, events)

    route, reason = route_rule(pool, setting)
    if route is Route.tcp and device is not Device.cpu:
        raise ConfigError("transport.route", setting.value,
                          f"auto or engine with mem_pool={pool.value}, whose buffers live on {device.value} "
                          "(the tcp route can only read and write host memory)")

    engine: Optional[EngineTransport] = None
    env: dict[str, Optional[str]] = {}
    if route is Route.engine:
        engine = _engine_transport(transport.mooncake, device, bool(events), platform)
        env = engine_env(engine, transport.mooncake.tcp_progress_timeout_s)

    prefill_gpus = decode_gpus = None
    if device is Device.cuda:
        prefill_gpus, decode_gpus = _gpu_placement(endpoints, platform)
    e = endpoints
    here = processes_on_gpus(prefill_gpus if role is not Role.decode else None,  # this command's own
                             decode_gpus if role is not Role.prefill else None, e.decode_ranks, e.decode_tp)
    sharing = sharing_rule(e.mps, here, platform.mps_control, platform.mps_pipe)

    return Plan(
        mem_pool=pool,
        buffer_device=device,
        route=route,
        route_reason=reason,
        engine_transport=engine,
        mc_env=env,
        protocol=mooncake_protocol(engine) if engine else None,
        prefill_gpus=prefill_gpus,
        decode_gpus=decode_gpus,
        fallback=policy,
        completion=completion_rule(transport.mooncake.completion, platform.cpu_count),
        events=tuple(events),
        sharing=sharing,
    )


def _cuda_or_fallback(pool: MemPoolType, policy: FallbackPolicy, platform: Platform,
                      events: list[PlanEvent]) -> Device:
    """CUDA buffers where CUDA and Mooncake's CUDA transports are there; else host buffers
    (transport.fallback=degrade, recorded in `events`) or a ConfigError (strict)."""
    missing = None
    if not platform.cuda:
        missing = (Reason.degraded_no_cuda, "no CUDA device is visible")
    elif not platform.mooncake_cuda:
        missing = (Reason.degraded_no_cuda_mooncake,
                   "the installed Mooncake wheel has no CUDA transports")
    if missing is None:
        return Device.cuda
    reason, why = missing
    if policy is FallbackPolicy.strict:
        raise ConfigError(
            "mem_pool", pool.value,
            f"NONE, NVLINK or BAREX here ({why}); or set transport.fallback=degrade "
            "to run on host buffers over Mooncake's TCP transport",
        )
    events.append(PlanEvent("fallback", reason,
                            f"{pool.value} wants CUDA buffers but {why}: host buffers, engine over tcp"))
    return Device.cpu


def _engine_transport(mooncake: MooncakeConfig, device: Device, degraded: bool,
                      platform: Platform) -> EngineTransport:
    """The engine route's Mooncake transport (tcp after a fallback, unless one was set), with
    the combinations that cannot register the buffers refused."""
    mc_setting = mooncake.transport
    if degraded and mc_setting is EngineTransportSetting.auto:
        transport = EngineTransport.tcp
    else:
        transport = engine_transport_rule(mc_setting, device)
    if transport is EngineTransport.nvlink_intra and device is not Device.cuda:
        raise ConfigError(
            "transport.mooncake.transport", mc_setting.value,
            "auto, tcp or rdma for host buffers (nvlink_intra moves CUDA memory only; "
            "use mem_pool=INTRA_NODE_NVLINK)",
        )
    if transport is EngineTransport.nvlink_intra:
        for var in expandable_segments(platform.env):
            raise ConfigError(
                var, platform.env[var],
                "no expandable_segments:True with nvlink_intra (cuMemCreate memory has "
                "no CUDA IPC handle and fails to register)",
            )
    return transport
