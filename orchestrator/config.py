"""Config schema: the dataclasses Hydra validates every profile and override against.

Everything a user can type lives here, once. The dataclasses are stored in Hydra's
ConfigStore and named first in ``conf/config.yaml``'s defaults list, so Hydra itself rejects
a misspelled key, a value of the wrong type, or an enum value that does not exist (enums are
matched by member NAME, so members are spelled exactly as users type them). What OmegaConf
cannot check (ranges, ports, hosts) is checked by :func:`validate`, which turns each problem
into one sentence naming the key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError


class MemPoolType(Enum):
    """SGLANG_MOONCAKE_CUSTOM_MEM_POOL values. NONE stands for "no custom pool"."""

    NONE = "NONE"
    NVLINK = "NVLINK"
    BAREX = "BAREX"
    INTRA_NODE_NVLINK = "INTRA_NODE_NVLINK"


class RouteSetting(Enum):
    """transport.route: let the rules decide (auto), or force one route."""

    auto = "auto"
    tcp = "tcp"
    engine = "engine"


class FallbackPolicy(Enum):
    """transport.fallback: stop when the declared path is unavailable, or degrade and log it."""

    strict = "strict"
    degrade = "degrade"


class EngineTransportSetting(Enum):
    """transport.mooncake.transport: which Mooncake transport the engine route should use.

    auto derives it from where the buffers live (CUDA buffers of an INTRA_NODE_NVLINK pool:
    nvlink_intra; host buffers: tcp). rdma is for hosts with an HCA.
    """

    auto = "auto"
    tcp = "tcp"
    rdma = "rdma"
    nvlink_intra = "nvlink_intra"


class FaultKind(Enum):
    """faults.kind: a failure injected on purpose, to show how the run ends (RELIABILITY.md)."""

    none = "none"
    decode_killed = "decode_killed"  # SIGKILL the decode process after `at_request` handoffs
    decode_stopped = "decode_stopped"  # SIGSTOP it for `duration_s`, then SIGCONT
    silent_control = "silent_control"  # prefill's control peer accepts TCP and never answers
    silent_peer = "silent_peer"  # the engine session id points at a port that never answers
    bad_destination = "bad_destination"  # one block of the batch aims outside the registration
    wrong_session = "wrong_session"  # the batch goes to a session id nobody serves
    stale_room = "stale_room"  # the room block is not sent and decode does not zero freed rooms
    corrupt_byte = "corrupt_byte"  # one byte of the row changes after its checksum was taken


class HiddenStatesDtype(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class MemPoolConfig:
    type: MemPoolType = MemPoolType.NONE
    description: str = ""


@dataclass
class BuffersConfig:
    size: int = 64  # slots (rows) per MetadataBuffers
    hidden_size: int = 16
    hidden_states_dtype: HiddenStatesDtype = HiddenStatesDtype.float32
    max_top_logprobs_num: int = 128
    output_dsa_topk_indices_dim: int = 0  # > 0 adds the DSA top-k field


@dataclass
class MooncakeConfig:
    metadata_server: str = "P2PHANDSHAKE"
    transport: EngineTransportSetting = EngineTransportSetting.auto
    device_name: str = ""  # RDMA device list ("" = let Mooncake pick)
    # MC_TCP_PROGRESS_TIMEOUT_SEC: bounds a write to a stopped peer (Mooncake's default is 30 s).
    tcp_progress_timeout_s: int = 5
    # A batch holds one block per field; more blocks than this in one batch is refused
    # (Mooncake's TCP transport failed a 2,560-block batch).
    max_blocks_per_batch: int = 1024


@dataclass
class TransportConfig:
    route: RouteSetting = RouteSetting.auto
    fallback: FallbackPolicy = FallbackPolicy.strict
    host: str = "127.0.0.1"  # data and control planes bind here; loopback unless declared
    allow_remote: bool = False  # a non-loopback host must be allowed explicitly
    # Name of an environment variable holding a shared secret; when set, control and status
    # messages carry an HMAC-SHA256 and unauthenticated ones are rejected (the secret itself
    # never lands in the config or the run dir).
    secret_env: Optional[str] = None
    timeout_s: float = 10.0  # a peer silent this long is declared lost
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)


@dataclass
class WorkloadConfig:
    requests: int = 1000
    concurrency: int = 8
    return_logprob: bool = True
    top_logprobs_num: int = 5
    hidden_states: bool = True
    seed: int = 0


@dataclass
class EndpointsConfig:
    # How many prefill and decode processes; every prefill rank hands off to every decode
    # rank (round-robin over its requests). workload.requests is per prefill rank.
    prefill_ranks: int = 1
    decode_ranks: int = 1
    # CUDA device of each rank when buffers live on CUDA (one entry per rank); null = auto:
    # prefill ranks on the first GPUs, decode ranks on the next ones, wrapping around when
    # there are fewer GPUs than ranks (1x1 on two GPUs: prefill 0, decode 1).
    prefill_gpus: Optional[List[int]] = None
    decode_gpus: Optional[List[int]] = None
    startup_timeout_s: float = 60.0


@dataclass
class FaultsConfig:
    kind: FaultKind = FaultKind.none
    at_request: int = 50  # first request (or handoff count) the fault hits
    every: int = 10  # per-request faults: then every Nth request
    duration_s: float = 2.0  # decode_stopped: how long the process stays stopped


@dataclass
class BenchConfig:
    """python -m orchestrator.bench: sizes of the measurement (ignored by plain runs)."""

    iters: int = 2000  # send_aux and raw batch writes, each, per engine path
    handoffs: int = 500  # full-protocol handoffs per path, one in flight
    bulk_mib: int = 64  # one-block bandwidth point per engine path (0 = skip)
    bulk_reps: int = 20


@dataclass
class OrchestratorConfig:
    mem_pool: MemPoolConfig = field(default_factory=MemPoolConfig)
    buffers: BuffersConfig = field(default_factory=BuffersConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    endpoints: EndpointsConfig = field(default_factory=EndpointsConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)


_SCHEMAS = {c.__name__: c for c in (MemPoolConfig, BuffersConfig, MooncakeConfig, TransportConfig,
                                    WorkloadConfig, EndpointsConfig, BenchConfig, FaultsConfig,
                                    OrchestratorConfig)}


def register_configs() -> None:
    """Store the schema; conf/config.yaml names it first in its defaults list."""
    ConfigStore.instance().store(name="orchestrator_schema", node=OrchestratorConfig)


class ConfigError(ValueError):
    """A user mistake in the config: rendered as one line, never with a traceback."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is not allowed: {allowed}.")


_POSITIVE_INTS = (
    ("buffers.size", "a whole number of slots > 0"),
    ("buffers.hidden_size", "a whole number > 0"),
    ("buffers.max_top_logprobs_num", "a whole number > 0"),
    ("workload.concurrency", "a whole number > 0"),
    ("endpoints.prefill_ranks", "a whole number of processes > 0"),
    ("endpoints.decode_ranks", "a whole number of processes > 0"),
    ("transport.mooncake.tcp_progress_timeout_s", "a whole number of seconds > 0"),
    ("transport.mooncake.max_blocks_per_batch", "a whole number > 0"),
    ("bench.iters", "a whole number > 0"),
    ("bench.handoffs", "a whole number > 0"),
    ("bench.bulk_reps", "a whole number > 0"),
)


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _unknown_key(node: Any, schema: type, prefix: str = "") -> Optional[str]:
    """First key of `node` that the dataclass `schema` does not declare (Hydra lets
    `+group.key=value` through on structured nodes)."""
    declared = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        if key not in declared:
            return f"{prefix}{key}"
        ftype = declared[key].type
        sub = _SCHEMAS.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        if sub is not None and isinstance(node[key], DictConfig):
            found = _unknown_key(node[key], sub, f"{prefix}{key}.")
            if found:
                return found
    return None


def validate(cfg: DictConfig | OrchestratorConfig) -> OrchestratorConfig:
    """Range and consistency checks OmegaConf does not do; returns the typed config object.

    Raises ConfigError for the first problem found (one actionable sentence).
    """
    if isinstance(cfg, DictConfig):
        unknown = _unknown_key(cfg, OrchestratorConfig)
        if unknown:
            raise ConfigError(unknown, OmegaConf.select(cfg, unknown),
                              "no such key in the schema (see conf/ or --cfg job)")
        try:  # typed even when the source was a plain YAML (a saved run's config)
            merged = OmegaConf.merge(OmegaConf.structured(OrchestratorConfig), cfg)
        except ValidationError as exc:
            key = str(exc.full_key)
            raise ConfigError(key, OmegaConf.select(cfg, key, default=None),
                              exc.msg.split("\n")[0]) from None
        obj: OrchestratorConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    else:
        obj = cfg
    for key, allowed in _POSITIVE_INTS:
        value = _get(obj, key)
        if value <= 0:
            raise ConfigError(key, value, allowed)
    w = obj.workload
    if w.requests < 0:
        raise ConfigError("workload.requests", w.requests, "a whole number >= 0")
    if not 0 <= w.top_logprobs_num <= obj.buffers.max_top_logprobs_num:
        raise ConfigError(
            "workload.top_logprobs_num", w.top_logprobs_num,
            f"0..buffers.max_top_logprobs_num ({obj.buffers.max_top_logprobs_num})",
        )
    if obj.buffers.output_dsa_topk_indices_dim < 0:
        raise ConfigError("buffers.output_dsa_topk_indices_dim",
                          obj.buffers.output_dsa_topk_indices_dim, "0 (off) or a positive dimension")
    if obj.transport.timeout_s <= 0:
        raise ConfigError("transport.timeout_s", obj.transport.timeout_s, "seconds > 0")
    if obj.endpoints.startup_timeout_s <= 0:
        raise ConfigError("endpoints.startup_timeout_s", obj.endpoints.startup_timeout_s, "seconds > 0")
    for role in ("prefill", "decode"):
        key, ranks = f"endpoints.{role}_gpus", _get(obj, f"endpoints.{role}_ranks")
        gpus = _get(obj, key)
        if gpus is not None and (len(gpus) != ranks or min(gpus) < 0):
            raise ConfigError(key, gpus, f"null (auto) or {ranks} CUDA device indices >= 0, one per "
                                         f"rank (endpoints.{role}_ranks={ranks})")
    try:
        host = ipaddress.IPv4Address(obj.transport.host)
    except ValueError:
        raise ConfigError("transport.host", obj.transport.host,
                          "an IPv4 address to bind (127.0.0.1 by default)") from None
    if not host.is_loopback and not obj.transport.allow_remote:
        raise ConfigError("transport.host", obj.transport.host,
                          "a loopback address (127.0.0.0/8), or set transport.allow_remote=true "
                          "to expose the data and control planes on that address")
    f = obj.faults
    if f.at_request < 0 or f.every <= 0 or f.duration_s <= 0:
        raise ConfigError("faults", f"at_request={f.at_request} every={f.every} duration_s={f.duration_s}",
                          "at_request >= 0, every > 0, duration_s > 0")
    ms = obj.transport.mooncake.metadata_server
    if ms != "P2PHANDSHAKE" and not ms.startswith(("etcd://", "redis://", "http://", "https://")):
        raise ConfigError("transport.mooncake.metadata_server", ms,
                          "P2PHANDSHAKE or an etcd://, redis:// or http(s):// address")
    return obj
