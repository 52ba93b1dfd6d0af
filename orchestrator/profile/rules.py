"""The rule book: can this profile run on this machine, and how? One function answers it
for the run, the doctor and export_env alike, so they can never disagree.

Each rule reads the sections it judges; `check` applies them all to the sections of a
validated config (orchestrator.profile.config.validate ran every section's own range and
form checks, once; orchestrator.job.check.check_profile hands them over) and returns the Plan
or raises ConfigError (one line: key, value, what is allowed). It applies, in order:
  1. a named secret must be set;
  2. the plan's rules: device, route, engine transport, fallback, GPU placement,
     allocator settings (orchestrator.profile.plan);
  3. what a fault needs (a route, TP ranks);
  4. the secret: a run across hosts must name one; NVLink stays on one host; rdma needs an
     RDMA device unless it may degrade;
  5. the digest: blake2b reads rows on the host;
  6. the metadata service the runner would start;
  7. memory: every process's buffers must fit the host's available memory (host buffers)
     or their GPU's memory (CUDA buffers).
Pure: the machine is described by `platform` (its env snapshot included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from orchestrator.profile.config import (
    WIDTH_KEYS,
    BuffersConfig,
    ConfigError,
    DigestKind,
    EndpointsConfig,
    FallbackPolicy,
    FaultKind,
    FaultsConfig,
    GateConfig,
    LayoutConfig,
    MemPoolConfig,
    MooncakeConfig,
    Role,
    TransportConfig,
    WorkloadConfig,
    is_loopback,
)
from orchestrator.profile.fault_table import FAULTS
from orchestrator.profile.kinds import run_secret, secret_from_env
from orchestrator.profile.plan import Device, EngineTransport, Plan, Platform, Route, make_plan

MAX_REQUEST_ID = (1 << 63) - 1  # request ids travel as signed 64-bit numbers (rooms: 63 bits)
MAX_OPEN_LOOP_REQUESTS = 100_000_000  # arrival times are drawn up front (8 bytes each)
RATE_WAIT_TIMEOUTS = 100  # the first arrival expected within this many transport.timeout_s


def check(*, transport: TransportConfig, workload: WorkloadConfig, endpoints: EndpointsConfig,
          gate: GateConfig, mem_pool: MemPoolConfig, role: Role, faults: FaultsConfig, digest: DigestKind,
          buffers: BuffersConfig, layout: LayoutConfig, platform: Platform) -> Plan:
    """The rule book, in its order (the module's docstring), over the sections it judges: the
    Plan of this profile on `platform`, or ConfigError naming the first rule it breaks."""
    t, e = transport, endpoints
    check_inputs(t, workload, e, gate, platform)
    plan = make_plan(mem_pool, t, e, role, platform)
    check_fault(faults, e, role, plan)
    check_hosts(t, role, plan, platform)
    check_digest_and_metadata(digest, t.mooncake, plan)
    check_memory(e, role, buffers, buffer_bytes(buffers, layout), plan, platform)
    return plan


@dataclass(frozen=True)
class Checked:
    """What a job reads of the rule book's verdict (`check_job`): its plan, that plan as results.json
    records it (Plan.as_dict), one row's present fields as the profile lays them out
    (layout.profile_layout: name, dtype, bytes) and the run's secret (the one
    transport.secret_env names, read from the env the rule book judged; else a fresh one)."""

    plan: Plan
    record: dict[str, Any]
    fields: list[list[Any]]
    secret: bytes = field(repr=False)


def check_job(*, transport: TransportConfig, workload: WorkloadConfig, endpoints: EndpointsConfig,
              gate: GateConfig, mem_pool: MemPoolConfig, role: Role, faults: FaultsConfig, digest: DigestKind,
              buffers: BuffersConfig, layout: LayoutConfig, platform: Platform) -> Checked:
    """`check` (ConfigError), and what a job reads of its plan, in one call."""
    plan = check(transport=transport, workload=workload, endpoints=endpoints, gate=gate, mem_pool=mem_pool,
                 role=role, faults=faults, digest=digest, buffers=buffers, layout=layout, platform=platform)
    return checked(plan, buffers, layout, transport.secret_env, platform.env)


def checked(plan: Plan, buffers: BuffersConfig, layout: LayoutConfig, secret_env: Optional[str],
            env: Optional[Mapping[str, str]] = None) -> Checked:
    """What a job reads of a plan made beforehand (`env`: None, this process's)."""
    from orchestrator.profile.layout import profile_layout

    return Checked(plan, plan.as_dict(), profile_layout(buffers, layout), run_secret(secret_env, env))


def _check_workload(w: WorkloadConfig, ranks: int, t: float) -> None:
    """Request ids fit their 64-bit fields (every rank's, endpoints.prefill_ranks=`ranks`: ids
    run to requests x ranks, and rooms derive from them), and an open loop's first arrival is
    expected in reasonable time (transport.timeout_s=`t`)."""
    if w.requests * ranks - 1 > MAX_REQUEST_ID:
        raise ConfigError("workload.requests", w.requests,
                          f"at most {MAX_REQUEST_ID // ranks:,} with endpoints.prefill_ranks={ranks} "
                          f"(request ids, requests x ranks, must stay below 2^63)")
    if w.rate is None:
        return
    if w.requests > MAX_OPEN_LOOP_REQUESTS:
        raise ConfigError("workload.requests", w.requests,
                          f"at most {MAX_OPEN_LOOP_REQUESTS:,} with workload.rate set (each arrival "
                          "time is drawn before the run)")
    if 1.0 / w.rate > t * RATE_WAIT_TIMEOUTS:
        raise ConfigError("workload.rate", w.rate,
                          f"at least {1.0 / (t * RATE_WAIT_TIMEOUTS):g} requests per second: the first "
                          f"arrival is expected after 1/rate s, over {RATE_WAIT_TIMEOUTS} x "
                          f"transport.timeout_s={t:g}")


def check_inputs(t: TransportConfig, w: WorkloadConfig, e: EndpointsConfig, g: GateConfig,
                 platform: Platform) -> None:
    """Before the plan: a named secret is set, the workload's ids and first arrival fit, and
    gate.never_landed_s stays within transport.timeout_s."""
    if t.secret_env is not None:  # the variable it names holds a usable secret
        secret_from_env(t.secret_env, platform.env)
    _check_workload(w, e.prefill_ranks, t.timeout_s)
    held = g.never_landed_s
    if held is not None and held > t.timeout_s:
        raise ConfigError("gate.never_landed_s", held,
                          f"null or at most transport.timeout_s={t.timeout_s:g} (it only shortens "
                          "the hold of a room that never lands)")


def check_fault(f: FaultsConfig, e: EndpointsConfig, role: Role, plan: Plan) -> None:
    """What the fault needs: the engine route (some), a decode TP rank, both sides at once."""
    if FAULTS[f.kind].engine_only and plan.route is not Route.engine:
        allowed = sorted(k.value for k in FaultKind if not FAULTS[k].engine_only)
        raise ConfigError("faults.kind", f.kind.value,
                          f"one of {', '.join(allowed)} with the tcp route (the others need the "
                          "engine route)")
    if f.kind is FaultKind.status_first and f.rank >= e.decode_tp:
        raise ConfigError("faults.rank", f.rank,
                          f"a decode TP rank below endpoints.decode_tp={e.decode_tp}")
    if role is not Role.both and not FAULTS[f.kind].split:
        split = sorted(k.value for k in FaultKind if FAULTS[k].split)
        raise ConfigError("faults.kind", f.kind.value,
                          f"one of {', '.join(split)} with "
                          f"role={role.value} (the other faults act on both sides at once)")


def check_hosts(t: TransportConfig, role: Role, plan: Plan, platform: Platform) -> None:
    """Across hosts: a run must name a secret; rdma needs an RDMA device unless it may degrade;
    NVLink stays on one host."""
    remote = not is_loopback(t.host)  # auto too: an address on the default route
    if (remote or role is not Role.both) and t.secret_env is None:
        why = "a non-loopback transport.host" if remote else f"role={role.value}"
        raise ConfigError("transport.secret_env", None,
                          f"the name of an environment variable holding a secret shared by both "
                          f"sides: {why} means two hosts, and a run's own generated secret "
                          "cannot cross to the other one")
    if (plan.route is Route.engine and plan.engine_transport is EngineTransport.rdma
            and not platform.rdma_devices and t.fallback is FallbackPolicy.strict):
        raise ConfigError("transport.mooncake.transport", t.mooncake.transport.value,
                          "tcp, or rdma with transport.fallback=degrade: this host has no RDMA "
                          "device (/sys/class/infiniband is empty) and the engine would quietly "
                          "come up on TCP")
    if (remote and role is not Role.both and plan.route is Route.engine
            and plan.engine_transport is EngineTransport.nvlink_intra):
        raise ConfigError("transport.mooncake.transport", t.mooncake.transport.value,
                          f"tcp or rdma with role={role.value} and transport.host={t.host}: "
                          "it gives nvlink_intra here, and NVLink joins GPUs of one host (use a "
                          "loopback transport.host when both sides run on this one)")


def check_digest_and_metadata(digest: DigestKind, mc: MooncakeConfig, plan: Plan) -> None:
    """blake2b reads rows on the host; the metadata service the runner would start is its own."""
    if digest is DigestKind.blake2b and plan.buffer_device is not Device.cpu:
        raise ConfigError("verify.digest", "blake2b",
                          f"linear with {plan.buffer_device.value} buffers (blake2b reads rows "
                          "on the host)")
    if mc.start_metadata_server:
        url = urlsplit(mc.metadata_server)
        if url.scheme != "http" or not is_loopback(url.hostname):
            raise ConfigError("transport.mooncake.start_metadata_server", True,
                              "false unless transport.mooncake.metadata_server is an "
                              "http://127.x.x.x:PORT/metadata address the run can serve itself")


def buffer_bytes(b: BuffersConfig, layout: LayoutConfig) -> int:
    """One process's MetadataBuffers arena (every present field, 256-byte aligned, plus its
    alignment slack and warm-up scratch), computed from the layout without allocating."""
    from orchestrator.profile.layout import Sizes, row_bytes

    sizes = Sizes(b.hidden_size, b.hidden_states_dtype.value, b.max_sampling_mask_tokens,
                  b.max_top_logprobs_num, b.output_dsa_topk_indices_dim, b.kv_checksum_enabled,
                  b.enable_sampling_mask)
    return sum(-(-b.size * n // 256) * 256 for n in row_bytes(layout, sizes)) + 3 * 256


def _memory_key(b: BuffersConfig) -> tuple[str, int]:
    """The key buffers that do not fit are blamed on: buffers.size, or the row width furthest
    above its default (buffers.hidden_size=100000000 is the row's fault, not the 64 slots')."""
    base = BuffersConfig()
    key, value, ratio = "buffers.size", b.size, b.size / base.size
    for name in WIDTH_KEYS:
        v = getattr(b, name)
        if v / max(1, getattr(base, name)) > ratio:
            key, value, ratio = f"buffers.{name}", v, v / max(1, getattr(base, name))
    return key, value


def check_memory(e: EndpointsConfig, role: Role, b: BuffersConfig, each: int, plan: Plan,
                  platform: Platform) -> None:
    """Every process's buffers (`each` bytes, buffers.size slots) fit where they live; what
    does not is blamed on the key furthest above its default, with the product named."""
    size = b.size
    key, value = _memory_key(b)
    fix = "fewer slots" if key == "buffers.size" else f"a smaller {key}"
    shape = f"buffers.size={size:,} slots of {-(-each // size):,} bytes"
    if key != "buffers.size":
        shape += f" ({key}={value:,})"
    if plan.buffer_device is Device.cpu:
        procs = ((e.prefill_ranks if role is not Role.decode else 0)
                 + (e.decode_ranks * e.decode_tp if role is not Role.prefill else 0))
        need, have = each * procs, platform.host_mem_bytes
        if have is not None and need > have:
            raise ConfigError(key, value,
                              f"{fix}: {shape} in {procs} processes' host buffers would "
                              f"need {need:,} bytes ({each:,} each) and this host has {have:,} "
                              "bytes available")
    elif plan.buffer_device is Device.cuda and platform.gpu_mem_bytes:
        per_gpu: dict[int, int] = {}
        for gpu in (plan.prefill_gpus or ()) + (plan.decode_gpus or ()):
            per_gpu[gpu] = per_gpu.get(gpu, 0) + each
        for gpu, need in sorted(per_gpu.items()):
            have = platform.gpu_mem_bytes[gpu] if gpu < len(platform.gpu_mem_bytes) else None
            if have is not None and need > have:
                raise ConfigError(key, value,
                                  f"{fix}: {shape}: the buffers on GPU {gpu} would need "
                                  f"{need:,} bytes ({each:,} per process) and it has {have:,} bytes")
